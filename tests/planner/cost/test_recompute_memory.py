"""What Megatron's full recomputation keeps, as the planner counts it (planner/cost/
recompute_memory.py): one input per checkpointed group and the kept layers' activations; a
backward's highest point walked over the chunk's layers. Measured against CPU runs:
test_memory_measured.py (within 10%, uniform and block, TeraPipe's and Megatron's schedules);
the list estimate's arrays against the walk: test_list_estimate.py."""

from __future__ import annotations

import random

import pytest

from megatron_terapipe.planner.cli.command import main
from megatron_terapipe.planner.cost.analytic import AnalyticCostModel
from megatron_terapipe.planner.cost.presets import HARDWARE_PRESETS, MODEL_PRESETS
from megatron_terapipe.planner.cost.recompute_time import FullRecompute
from megatron_terapipe.planner.cost.recompute_memory import (RecomputedMemory, backward_walk,
                                                             memory_of)
from megatron_terapipe.planner.cost.stage_memory import CostModelMemory

MODEL = MODEL_PRESETS["gpt3-13b"]
COST = AnalyticCostModel(MODEL, HARDWARE_PRESETS["h100"], 5, tensor_parallel=8, inter_node=True)
X = 8192 * MODEL.hidden_size * 2  # a group's input: one 8192-token sequence's hidden states, bf16


def test_the_groups_megatron_checkpoints():
    assert FullRecompute("uniform", 1).groups(3) == ((0, 1), (1, 2), (2, 3))
    assert FullRecompute("uniform", 2).groups(5) == ((0, 2), (2, 4), (4, 5))
    assert FullRecompute("block", 2).groups(5) == ((0, 1), (1, 2))
    assert FullRecompute("block", 7).groups(3) == ((0, 1), (1, 2), (2, 3))
    assert FullRecompute("block", 0).groups(3) == ()


def test_without_groups_the_walk_is_the_closed_form():
    rng = random.Random(3)
    for _ in range(500):
        L = rng.randint(1, 8)
        a, g, h, out = (rng.uniform(0, 10) for _ in range(4))
        f = rng.uniform(0, 1)
        h = min(h, a)
        closed = max(0.0, max(g - f * a, L * g - (L - 1) * (a - h) - f * a) - out)
        assert backward_walk(L, (), a, 1.0, g, f, h, out) == pytest.approx(closed, abs=1e-9)


def test_a_cell_keeps_its_group_inputs_and_kept_layers():
    plain = CostModelMemory(COST)
    a = plain.cell_bytes(1, 8192, 0, False, False) / 5  # one layer's activations
    uniform = memory_of(COST.with_recompute(FullRecompute("uniform", 1)))
    block = memory_of(COST.with_recompute(FullRecompute("block", 2)))
    assert isinstance(uniform, RecomputedMemory) and memory_of(COST).__class__ is CostModelMemory
    assert uniform.cell_bytes(1, 8192, 0, False, False) == pytest.approx(5 * X)
    assert block.cell_bytes(1, 8192, 0, False, False) == pytest.approx(3 * a + 2 * X)
    # the output layer's bytes stay on the last stage; K/V buffers and W holds are the same
    out = plain.cell_bytes(1, 8192, 0, False, True) - plain.cell_bytes(1, 8192, 0, False, False)
    assert uniform.cell_bytes(1, 8192, 0, False, True) == pytest.approx(5 * X + out)
    assert uniform.kv_buffer_bytes(1, 8192) == plain.kv_buffer_bytes(1, 8192)
    assert uniform.wgrad_hold_bytes(1, 8192, False, False) == plain.wgrad_hold_bytes(1, 8192, False, False)
    # a one-layer chunk of the interleaved layout: its layer is its group
    assert uniform.cell_bytes(1, 8192, 0, False, False, layers=1) == pytest.approx(X)


def test_a_backward_brings_one_group_back():
    """Uniform groups of 1 on 5 layers, no K/V gradients: the top group's rerun is the highest
    point (a - X above the start); uniform groups of 5: all five layers at once."""
    plain = CostModelMemory(COST)
    a = plain.cell_bytes(1, 8192, 0, False, False) / 5
    one = memory_of(COST.with_recompute(FullRecompute("uniform", 1)))
    five = memory_of(COST.with_recompute(FullRecompute("uniform", 5)))
    assert one.backward_rise(1, 8192, 0, 8192, False, False, kv_grads=False) == pytest.approx(a - X)
    assert five.backward_rise(1, 8192, 0, 8192, False, False, kv_grads=False) == pytest.approx(
        5 * a - X)
    assert plain.backward_rise(1, 8192, 0, 8192, False, False, kv_grads=False) == 0.0
    # Megatron's microbatch: its layers keep their K/V too, and a rerun brings them back
    whole = plain.microbatch_bytes(1, 8192, False, False) / 5
    assert one.microbatch_bytes(1, 8192, False, False) == pytest.approx(5 * X)
    assert one.microbatch_backward_rise(1, 8192, False, False) == pytest.approx(whole - X)


def test_terapipe_plan_counts_what_it_saves(capsys):
    argv = ("--model gpt3-13b --hardware h100 --pipeline-stages 8 --tensor-parallel-size 8 "
            "--seq-length 8192 --num-microbatches 8 --virtual-stages 1").split()

    def megatron_1f1b_first_stage_gib(text: str) -> float:
        line = next(x for x in text.splitlines() if x.strip().startswith("Megatron 1F1B"))
        words = line.split()
        return float(words[words.index(next(w for w in words if w.endswith("%"))) + 1])

    main(argv)
    plain = megatron_1f1b_first_stage_gib(capsys.readouterr().out)
    main(argv + ["--recompute-method", "uniform"])
    text = capsys.readouterr().out
    assert "full recompute (uniform, 1 layer)" in text
    # 8 microbatches in flight on the first stage: 40 layers' activations (w each, K/V among
    # them), or 40 group inputs and, at the first backward, one layer rerun: 39 (w - X) less
    w = CostModelMemory(COST).microbatch_bytes(1, 8192, False, False) / 5
    saved = 39 * (w - X) / 2 ** 30
    assert plain - megatron_1f1b_first_stage_gib(text) == pytest.approx(saved, abs=0.02)


def test_a_measured_profile_takes_the_runs_recomputation(tmp_path):
    """A memory profile is measured without recomputation; planning a run with it counts what
    the run's groups keep (the group input in the run's dtype, split by sequence parallelism)."""
    from megatron_terapipe.planner.cost.dims import ModelDims
    from megatron_terapipe.planner.inputs import stage_memory
    from megatron_terapipe.planner.profile.memory_fit import FittedMemory
    from harness.inputs.cost_models import synthetic_measurements

    m = synthetic_measurements()
    m.metadata = {"model": {"hidden_size": 64}, "tensor_parallel": 2, "sequence_parallel": True}
    path = str(FittedMemory.fit(m, layers_per_stage=1).save(tmp_path / "m.json"))
    model = ModelDims(num_layers=6, hidden_size=64, num_attention_heads=4)
    plain = stage_memory(model, 2, path, tensor_parallel=2, sequence_parallel=True)
    rerun = stage_memory(model, 2, path, tensor_parallel=2, sequence_parallel=True,
                         recompute=FullRecompute("uniform", 3), dtype_bytes=2)
    assert isinstance(rerun, RecomputedMemory) and rerun.inner.describe() == plain.describe()
    assert rerun.input_bytes_per_token == 64 * 2 / 2
    edges = plain.cell_bytes(1, 32, 0, True, False, 0) - plain.cell_bytes(1, 32, 0, False, False, 0)
    assert rerun.cell_bytes(1, 32, 0, True, False) == pytest.approx(edges + 32 * 64.0)
