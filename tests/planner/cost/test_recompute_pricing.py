"""Megatron's full activation recomputation in the planner: every backward cell reruns the
forward of its chunk's recomputed layers (uniform: all of them; block: the first N of each
chunk), for TeraPipe's schedules and Megatron's alike. Its bytes: test_recompute_memory.py. Both schedules with recomputation
train exactly as Megatron's own run: test_equivalence.py's recompute cases and the Megatron-LM
matrix's recompute rows."""

from __future__ import annotations

import pytest

from megatron_terapipe.megatron.args.settings import RunShape, TeraPipeArgumentError
from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner.cli.command import main
from megatron_terapipe.planner.cost.analytic import AnalyticCostModel
from megatron_terapipe.planner.cost.presets import HARDWARE_PRESETS, MODEL_PRESETS
from megatron_terapipe.planner.cost.recompute_time import FullRecompute
from megatron_terapipe.planner.evaluate.list_estimate import estimate_lists
from megatron_terapipe.planner.evaluate.simulator import simulate, simulate_plan
from megatron_terapipe.schedule import build_interleaved_schedule, build_schedule
from megatron_terapipe.schedule.actions import VirtualCell
from harness.inputs.flags import parse

COST = AnalyticCostModel(MODEL_PRESETS["gpt3-13b"], HARDWARE_PRESETS["h100"], 5,
                         tensor_parallel=8, inter_node=True)


def test_what_share_of_a_chunk_is_recomputed():
    assert FullRecompute("uniform", 2).fraction(5) == 1.0
    assert FullRecompute("block", 2).fraction(5) == pytest.approx(0.4)
    assert FullRecompute("block", 2).fraction(1) == 1.0  # a chunk of one layer
    assert FullRecompute("block", 0).fraction(5) == 0.0
    with pytest.raises(ValueError, match="--recompute-method must be one of uniform, block"):
        FullRecompute("selective", 1)
    with pytest.raises(ValueError, match="--recompute-num-layers 0 is out of range"):
        FullRecompute("uniform", 0)
    assert COST.recomputed_share() == 0.0
    assert COST.with_recompute(FullRecompute("block", 2)).recomputed_share(0.2) == 1.0
    assert "full recompute (block, 2 layers)" in COST.with_recompute(
        FullRecompute("block", 2)).describe()


def _rerun_forwards(schedule, stage: int, recompute: FullRecompute) -> float:
    """What the stage's backward cells rerun: each cell's layer forward on its chunk, times
    the recomputed share of the chunk's layers."""
    total = 0.0
    for action in schedule.stages[stage]:
        if action.kind != "B":
            continue
        c = action.cell
        share = c.share if type(c) is VirtualCell else 1.0
        forward = float(COST.forward_time(c.rows, c.tokens, c.context)) * share
        total += forward * recompute.fraction(round(5 * share))
    return total


@pytest.mark.parametrize("V", [1, 5])
@pytest.mark.parametrize("recompute", [FullRecompute("uniform", 1), FullRecompute("block", 2)],
                         ids=["uniform", "block"])
def test_each_backward_pays_its_rerun_forward(V, recompute):
    plan = TeraPipePlan([4096, 4096], virtual_stages=V)
    K, M = 4, 3
    priced = COST.with_recompute(recompute)
    plain, with_it = (simulate_plan(plan, cost, M, K, 1) for cost in (COST, priced))
    schedule = build_schedule(plan, M, K, 1)
    for k in range(K):
        assert with_it.busy[k] == pytest.approx(
            plain.busy[k] + _rerun_forwards(schedule, k, recompute), rel=1e-9)
    assert estimate_lists(schedule, priced).busiest_compute == pytest.approx(max(with_it.busy),
                                                                             rel=1e-9)
    # its bytes (test_recompute_memory.py): every stage keeps less
    assert all(w < p for w, p in zip(with_it.peak_memory_bytes, plain.peak_memory_bytes))


def test_megatron_schedules_pay_it_too():
    """Megatron's 1F1B on 5-layer stages reruns 2 of 5 layers per backward with block 2; its
    interleaved schedule on 5 one-layer chunks reruns each chunk's one layer."""
    block = COST.with_recompute(FullRecompute("block", 2))
    M, K = 8, 8
    whole = TeraPipePlan([8192], order="1f1b", defer_wgrad=False)
    forward = float(COST.forward_time(1, 8192, 0))
    one_f1b = build_schedule(whole, M, K, 1)
    plain, priced = (simulate(one_f1b, cost, megatron=True) for cost in (COST, block))
    assert priced.busy[3] == pytest.approx(plain.busy[3] + M * 0.4 * forward, rel=1e-9)
    interleaved = build_interleaved_schedule(8192, M, K, 5, 1)
    plain, priced = (simulate(interleaved, cost, megatron=True) for cost in (COST, block))
    assert priced.busy[3] == pytest.approx(plain.busy[3] + M * forward, rel=1e-9)


def test_terapipe_plan_prices_it(capsys):
    argv = ("--model gpt3-13b --hardware h100 --pipeline-stages 8 --tensor-parallel-size 8 "
            "--seq-length 8192 --num-microbatches 8 --virtual-stages 1").split()
    main(argv)
    plain = capsys.readouterr().out
    main(argv + ["--recompute-method", "uniform"])
    priced = capsys.readouterr().out
    assert "full recompute (uniform, 1 layer)" in priced and "recompute" not in plain

    def megatron_1f1b_ms(text: str) -> float:
        line = next(x for x in text.splitlines() if x.strip().startswith("Megatron 1F1B"))
        return float(line.split()[2])

    assert megatron_1f1b_ms(priced) > megatron_1f1b_ms(plain)
    with pytest.raises(SystemExit):
        main(argv + ["--recompute-num-layers", "2"])
    assert "--recompute-num-layers needs --recompute-method" in capsys.readouterr().err


def test_megatron_lm_flags_give_the_recomputation():
    full = RunShape.from_args(parse([], recompute_granularity="full", recompute_method="block",
                                    recompute_num_layers=2))
    assert full.full_recompute == FullRecompute("block", 2)
    selective = RunShape.from_args(parse([], recompute_granularity="selective"))
    assert selective.full_recompute is None and selective.recompute
    assert RunShape.from_args(parse([])).full_recompute is None
    with pytest.raises(TeraPipeArgumentError, match="--recompute-method must be one of"):
        RunShape.from_args(parse([], recompute_granularity="full"))
