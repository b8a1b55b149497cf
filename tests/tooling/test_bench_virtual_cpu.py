"""What bench_virtual_cpu.py's rows compare (no processes started): each row's ratio pairs its
runs with the Megatron rows' runs of the same round, a round's time is its slower stage, the
targets are read off the rows, and a smoke run never overwrites the full run's results."""

from __future__ import annotations

import os
import statistics

import pytest

import bench_virtual_cpu as bench
from virtual_runs_bench import Row

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner import AnalyticCostModel, ModelDims, hardware_preset

MODEL = bench.TinyGPT(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=128,
                      seq_length=256)
ROWS = [Row("megatron_1f1b", bench.MEGATRON_1F1B),
        Row("megatron_interleaved_v2", bench.MEGATRON_INTERLEAVED, 2),
        Row("terapipe_v2", bench.TERAPIPE, 2,
            TeraPipePlan([128, 128], order="gpipe", virtual_stages=2))]


def _cost():
    dims = ModelDims(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=128)
    return AnalyticCostModel(dims, hardware_preset("h100"), 2, dtype_bytes=4)


def _per_rank() -> list[dict]:
    losses = [[10.0, 256.0]] * 4
    stage = {"megatron_1f1b": [2.0, 4.0, 2.0], "megatron_interleaved_v2": [1.6, 3.0, 2.0],
             "terapipe_v2": [1.0, 4.0, 1.6], "busy:terapipe_v2": [0.5, 0.6, 0.7]}
    slower = {k: [t + 0.1 for t in v] for k, v in stage.items()}  # the last stage: slower
    return [{"last_stage": False, **stage, **{"losses:" + r.label: None for r in ROWS}},
            {"last_stage": True, **slower, **{"losses:" + r.label: losses for r in ROWS}}]


def test_ratios_pair_each_run_with_the_megatron_runs_of_its_round():
    per_rank = _per_rank()
    rows = bench.result_rows(ROWS, per_rank, _cost(), MODEL, 4, 2.0, _cost())
    tera = next(r for r in rows if r["config"] == "terapipe_v2")
    slower = per_rank[1]  # every round's slower stage
    mega, inter = slower["megatron_1f1b"], slower["megatron_interleaved_v2"]
    assert tera["runs_s"] == slower["terapipe_v2"]
    assert tera["measured_s"] == statistics.median(slower["terapipe_v2"])
    assert tera["speedup_vs_megatron_1f1b"] == statistics.median(
        m / t for m, t in zip(mega, tera["runs_s"]))
    assert tera["speedup_vs_megatron_interleaved"] == statistics.median(
        i / t for i, t in zip(inter, tera["runs_s"]))
    assert tera["stage_busy_s"] == [statistics.median(p["busy:terapipe_v2"]) for p in per_rank]
    assert tera["stage_busy_simulated_s"] == bench.simulated_busy(_cost(), ROWS[2], 4)
    assert len(tera["stage_busy_simulated_s"]) == 2 and min(tera["stage_busy_simulated_s"]) > 0
    assert rows[0]["stage_busy_simulated_s"] is None
    assert tera["predicted_over_measured"] == tera["predicted_s"] / tera["measured_s"]
    alone = AnalyticCostModel(_cost().model, hardware_preset("a100"), 2, dtype_bytes=4)
    beside = bench.result_rows(ROWS, per_rank, _cost(), MODEL, 4, 2.0, alone)[2]
    assert beside["predicted_s"] == tera["predicted_s"]  # the in-run profile's
    assert beside["predicted_alone_profile_s"] == bench.predicted(alone, ROWS[2], MODEL, 4, 2.0)
    assert beside["predicted_alone_profile_s"] != tera["predicted_s"]
    assert tera["loss_rel_diff_vs_megatron_1f1b"] == 0.0
    assert rows[0]["speedup_vs_megatron_1f1b"] == 1.0 and rows[0]["stage_busy_s"] is None


def test_targets_are_read_off_the_rows():
    rows = bench.result_rows(ROWS, _per_rank(), _cost(), MODEL, 4, 2.0, _cost())
    for r in rows:
        r["predicted_over_measured"] = 1.05
    goal = bench.targets(rows, 1.2)
    assert goal["best_terapipe_virtual"] == "terapipe_v2"
    assert goal["bubble_free_limit_here_simulated"] == 1.2
    assert goal["speedup_met"] == (goal["speedup_vs_megatron_1f1b"] >= 1.20)
    assert goal["simulator_within_tolerance"] is True
    rows[1]["predicted_over_measured"] = 0.85  # one row off by more than 10%
    assert bench.targets(rows, 1.2)["simulator_within_tolerance"] is False


def test_the_no_bubble_limit_falls_as_the_stages_share_fewer_cores():
    """Equal stages, no transfers: on dedicated cores a schedule with no bubble gains
    (M + K - 1) / M over 1F1B; stages sharing cores lose less to 1F1B's bubble (a waiting stage
    lends the other its share), and on one core's worth there is nothing to gain."""
    from megatron_terapipe.planner import FunctionCostModel

    cost = FunctionCostModel(lambda b, l, c: 1e-3 * b * l / 256)  # no edges, no transfers
    limits = [bench.bubble_free_limit(cost, MODEL, 4, cores) for cores in (2.0, 1.5, 1.0)]
    assert limits == pytest.approx([(4 + 2 - 1) / 4, 1.125, 1.0])


def test_a_smoke_run_writes_its_own_file():
    """The full run replaces the current results file; a smoke run stays out of results/."""
    from results_layout import RESULTS

    quick, full = bench.parse_args(["--quick"]), bench.parse_args([])
    assert full.out == os.path.join(RESULTS, "cpu", "virtual.json")
    assert os.path.basename(quick.out) == "virtual_quick.json"
    assert not os.path.abspath(quick.out).startswith(RESULTS + os.sep)
    assert (full.seq_length, full.hidden_size, full.microbatches, full.rounds) == (2048, 512, 4, 7)
    assert quick.rounds == 2


def test_megatron_1f1b_is_predicted_as_the_planner_times_it():
    """The benchmarks' simulated Megatron 1F1B row is the schedule table's: weight gradients
    inside each backward (Megatron defers none), not TeraPipe's deferred W actions."""
    from pipeline_plans import predict

    from megatron_terapipe.planner import SearchSpace
    from megatron_terapipe.planner.cost.stage_memory import MemoryBudget
    from megatron_terapipe.planner.schedule_choice import compare_schedules

    space = SearchSpace(MODEL.seq_length, 1, 2, 4, order="1f1b", granularity=64)
    table = compare_schedules(_cost(), space, MemoryBudget(None), 2, orders=("1f1b",))
    megatron = next(o for o in table.options if o.name == "Megatron 1F1B")
    assert predict(_cost(), None, MODEL, 4, 2.0, 2) == pytest.approx(megatron.time, rel=1e-12)


def test_a_microbatch_count_megatrons_interleaved_schedule_refuses_stops_before_any_work():
    """The in-run profile runs Megatron's interleaved schedule first: a count it refuses ends
    the run at once, naming the option."""
    with pytest.raises(SystemExit, match="--microbatches 1: Megatron's interleaved 1F1B cannot"):
        bench.check_interleaved_runs(MODEL, 1)
    bench.check_interleaved_runs(MODEL, 4)  # runs
