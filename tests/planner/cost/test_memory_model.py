"""The planner's memory model (planner/cost/stage_memory.py, memory_fit.py, evaluate/memory_walk.py): sizes,
Megatron's model-state accounting, the fit of measured bytes, and the walk of a schedule's
actions that gives each stage's peak."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner import FunctionCostModel, ModelDims, simulate
from megatron_terapipe.planner.cost.stage_memory import (MemoryBudget, ModelStateConfig, StageMemory,
                                              model_state_bytes, parse_bytes, stage_parameters)
from megatron_terapipe.planner.profile.memory_fit import (FittedMemory, cell_features,
                                                  hold_features, whole_features)
from megatron_terapipe.schedule import build_interleaved_schedule, build_schedule
from harness.inputs.cost_models import TRUE_BYTES, synthetic_measurements, true_bytes

GiB = 1024 ** 3


@pytest.mark.parametrize("text,expected", [
    ("70GiB", 70 * GiB), ("80GB", 80e9), ("1.5TiB", 1.5 * 2 ** 40), ("512MiB", 512 * 2 ** 20),
    ("123456", 123456), ("2 gib", 2 * GiB), ("1e9", 1e9)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "GiB", "70 parsecs", "-1GiB", "7O GiB"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="70GiB"):
        parse_bytes(text)


def test_megatron_model_state_accounting():
    """18 bytes per parameter (16-bit weights, fp32 gradients, Adam with fp32 master weights
    and two moments), 6 + 12 / DP with the distributed optimizer; float32 training 16 and
    8 + 8 / DP. The first stage adds the word embedding, the last the output layer."""
    assert ModelStateConfig().bytes_per_parameter() == 18
    assert ModelStateConfig(data_parallel=4, distributed_optimizer=True).bytes_per_parameter() == 9
    assert ModelStateConfig(dtype_bytes=4).bytes_per_parameter() == 16
    assert ModelStateConfig(dtype_bytes=4, data_parallel=8,
                            distributed_optimizer=True).bytes_per_parameter() == 9
    model = ModelDims(num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=50304)
    first, middle, middle2, last = model_state_bytes(model, 2, 4)
    assert middle == middle2 == 18 * stage_parameters(model, 2, False, False)
    assert first - middle == pytest.approx(18 * 50304 * 1024)
    assert last - middle == pytest.approx(18 * (50304 * 1024 + 2 * 1024))
    # a layer is about 12 h^2 parameters
    assert stage_parameters(model, 1, False, False) == pytest.approx(12 * 1024 ** 2, rel=0.01)
    half = model_state_bytes(model, 2, 4, ModelStateConfig(tensor_parallel=2))
    assert half[1] == pytest.approx(middle / 2, rel=0.01)


def test_budget_adds_model_state():
    budget = MemoryBudget(10.0, (3.0, 1.0))
    assert budget.totals((7.0, 9.0)) == (10.0, 10.0) and budget.fits((7.0, 9.0))
    assert not budget.fits((7.5, 1.0))
    with pytest.raises(ValueError, match="positive"):
        MemoryBudget(0.0, (0.0,))


# ---- the fit -------------------------------------------------------------------------------

def test_fit_recovers_every_part(tmp_path):
    fitted = FittedMemory.fit(synthetic_measurements(), layers_per_stage=3)
    assert fitted.max_fit_error < 1e-9
    point = (3, 48, 80)
    expect = true_bytes(TRUE_BYTES["cell"], cell_features, point, 3, True, True)
    assert fitted.cell_bytes(*point, True, True) == pytest.approx(expect)
    assert fitted.cell_bytes(*point, False, False, layers=1.5) == pytest.approx(
        true_bytes(TRUE_BYTES["cell"], cell_features, point, 1.5, False, False))
    assert fitted.kv_buffer_bytes(2, 100) == 3 * 2 * 100 * 512.0
    assert fitted.wgrad_hold_bytes(2, 40, False, True) == pytest.approx(
        true_bytes(TRUE_BYTES["hold"], hold_features, (2, 40), 3, False, True))
    assert fitted.microbatch_bytes(2, 300, True, False) == pytest.approx(
        true_bytes(TRUE_BYTES["whole"], whole_features, (2, 300), 3, True, False))
    loaded = FittedMemory.load(fitted.save(tmp_path / "m.json"), layers_per_stage=3)
    assert loaded.cell_bytes(*point, True, True) == pytest.approx(expect)
    assert loaded.freed_before_kv_grad == 0.7 and loaded.freed_before_kv_grad_deferred == 0.4


def test_fit_needs_every_kind_and_files_say_what_is_wrong(tmp_path):
    m = synthetic_measurements()
    del m.cells["last1"]
    with pytest.raises(ValueError, match="cells of last1"):
        FittedMemory.fit(m)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format_version": 99}))
    with pytest.raises(ValueError, match=f"{path}.*format version 99"):
        FittedMemory.load(path)
    good = FittedMemory.fit(synthetic_measurements()).save(tmp_path / "good.json")
    with pytest.raises(ValueError, match="hidden_size=64.*hidden_size=128"):
        FittedMemory.load(good, model=ModelDims(1, 128, 4))


# ---- the walk ------------------------------------------------------------------------------

class Toy(StageMemory):
    """a bytes per layer-row-token of activations, g per row-token of K/V, one layer."""

    def __init__(self, a=10.0, g=1.0, f=0.5, hold=0.0):
        self.a, self.g, self.freed_before_kv_grad, self.hold = a, g, f, hold
        self.freed_before_kv_grad_deferred = f
        self.layers_per_stage = 1

    def cell_bytes(self, rows, tokens, context, first, last, layers=None):
        return self.a * rows * tokens * (1 if layers is None else layers)

    def kv_buffer_bytes(self, rows, seq_length, layers=None):
        return self.g * rows * seq_length * (1 if layers is None else layers)

    def wgrad_hold_bytes(self, rows, tokens, first, last, layers=None):
        return self.hold * rows * tokens * (1 if layers is None else layers)


def unit_cost():
    return FunctionCostModel(lambda b, l, c: np.ones(np.broadcast(b, l, c).shape))


@pytest.mark.parametrize("n", [1, 2, 8])
def test_kv_buffers_are_whole_sequences_from_the_first_forward(n):
    """One stage, one sequence of 64 tokens: after the first forward the whole sequence's
    K/V are live; after all forwards every activation; the peak is that, or the rise of the
    first backward: a 64/n-token slice frees f a t before its K/V gradients (g S) appear."""
    plan = replace(TeraPipePlan.uniform(64, n, order="1f1b"), defer_wgrad=False)
    toy = Toy()
    result = simulate(build_schedule(plan, 1, 1, 1), unit_cost(), memory=toy)
    first_forward = result.memory[0][0]
    assert first_forward.kv_bytes == 64 and first_forward.activation_bytes == 10 * 64 / n
    t = 64 / n
    rise = max(0.0, 64 - 0.5 * 10 * t)
    assert result.peak_memory_bytes[0] == pytest.approx(10 * 64 + 64 + rise)
    assert result.memory[0][-1].kv_bytes == 0 and result.memory[0][-1].activation_bytes == 0


def test_held_bytes_wait_for_the_w_action():
    plan = replace(TeraPipePlan.uniform(64, 4, order="gpipe"), defer_wgrad=True)
    result = simulate(build_schedule(plan, 1, 1, 1), unit_cost(), memory=Toy(hold=3.0))
    acts = [p.activation_bytes for p in result.memory[0]]
    assert acts[-2] == pytest.approx(3 * 64)  # every backward done, before the W
    assert acts[-1] == 0


def test_megatron_schedules_keep_whole_microbatches():
    """Megatron's 1F1B (megatron=True) and the interleaved schedule keep microbatch_bytes per
    microbatch (chunk share of the layers); the first rank of interleaved 1F1B holds the most."""
    toy = Toy()
    one = simulate(build_schedule(TeraPipePlan([64], defer_wgrad=False), 4, 2, 1), unit_cost(),
                   memory=toy, megatron=True)
    per_microbatch = toy.microbatch_bytes(1, 64, False, False)
    assert one.peak_memory_bytes == (2 * per_microbatch, per_microbatch)
    two = simulate(build_interleaved_schedule(64, 4, 2, 2, 1), unit_cost(), memory=toy)
    chunk = toy.microbatch_bytes(1, 64, False, False, layers=0.5)
    warmup = [(2 - k - 1) * 2 + 2 for k in range(2)]  # Megatron's warm-up forwards per rank
    assert two.peak_memory_bytes == tuple((w + 1) * chunk for w in warmup)


def test_a_memory_profile_must_match_the_runs_tp_layout(tmp_path, capsys):
    """Bytes measured at one TP size are not another's per rank: refused before planning,
    naming the option, as is a profile whose sequence parallelism differs from the run's."""
    from megatron_terapipe.planner.cli.command import main
    from megatron_terapipe.planner.inputs import stage_memory

    m = synthetic_measurements()
    m.metadata = {"model": {"hidden_size": 64}, "tensor_parallel": 1}
    path = FittedMemory.fit(m, layers_per_stage=1).save(tmp_path / "m.json")
    model = ModelDims(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert stage_memory(model, 2, str(path), tensor_parallel=1) is not None
    with pytest.raises(ValueError, match="measured at tensor-parallel size 1, but the run has 2"):
        stage_memory(model, 2, str(path), tensor_parallel=2)
    m.metadata["tensor_parallel"] = 2
    path = FittedMemory.fit(m, layers_per_stage=1).save(tmp_path / "m2.json")
    assert stage_memory(model, 2, str(path), tensor_parallel=2) is not None
    with pytest.raises(ValueError, match="without sequence parallelism"):
        stage_memory(model, 2, str(path), tensor_parallel=2, sequence_parallel=True)
    m.metadata["sequence_parallel"] = True  # fewer bytes per rank than a run without it keeps
    sp_path = FittedMemory.fit(m, layers_per_stage=1).save(tmp_path / "m2_sp.json")
    assert stage_memory(model, 2, str(sp_path), tensor_parallel=2, sequence_parallel=True) is not None
    with pytest.raises(ValueError, match="measured with sequence parallelism, which the run does not use"):
        stage_memory(model, 2, str(sp_path), tensor_parallel=2)
    with pytest.raises(SystemExit):
        main(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "256", "--pipeline-stages", "2", "--tensor-parallel-size", "4",
              "--memory-profile", str(path)])
    err = capsys.readouterr().err
    assert "--memory-profile" in err and "tensor-parallel size 2, but the run has 4" in err
