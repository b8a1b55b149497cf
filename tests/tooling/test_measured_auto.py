"""benchmarks/measured_auto.py: measured `auto` inside the GPU pipeline benchmark. A
MeasuredChoice among a way's rows keeps the fastest by the maximum over the stages, the
re-planned plan joins the rows before its first trial, and the kept row is held against the
rows timed alone."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from harness import spawn

#: Seconds per iteration of each label on each rank: rank 0 alone would keep terapipe_a; the
#: maximum over the ranks makes terapipe_b the fastest (0.05 against Megatron's 0.08).
SLEEP = {0: {"megatron_1f1b": 0.08, "terapipe_a": 0.01, "terapipe_b": 0.05,
             "terapipe_calibrated": 0.12},
         1: {"megatron_1f1b": 0.08, "terapipe_a": 0.15, "terapipe_b": 0.03,
             "terapipe_calibrated": 0.12}}


def choose_worker(rank: int, world_size: int, calibrated_sleep: float) -> dict:
    import torch.distributed as dist

    import measured_auto
    from megatron_terapipe import TrialCandidate
    from megatron_terapipe.plan import TeraPipePlan

    calibrated = TeraPipePlan([256] * 8)
    measured_auto._replan = lambda case, stages, way: (
        lambda measured: TrialCandidate("terapipe_calibrated", calibrated, None))
    sleeps = dict(SLEEP[rank], terapipe_calibrated=calibrated_sleep)
    case = SimpleNamespace(plans={"megatron_1f1b": None, "terapipe_a": TeraPipePlan([1024] * 2),
                                  "terapipe_b": TeraPipePlan([2048])},
                           graphed=(), predicted={}, auto_trials=2, cost="a cost model")
    events = []

    def run(label: str) -> None:
        assert label in case.plans, f"{label} ran before it joined the rows"
        events.append(("run", label))
        time.sleep(sleeps[label])

    def add_label(label, plan, graphed) -> None:
        events.append(("added", label, plan == calibrated, graphed))
        case.plans[label] = plan

    chosen = measured_auto.choose_in_stages(case, world_size, run, add_label, lambda: None,
                                            dist.new_group(backend="gloo"))
    return {"chosen": chosen, "events": events}


@pytest.mark.parametrize("calibrated_sleep,kept", [(0.12, "terapipe_b"),
                                                   (0.005, "terapipe_calibrated")])
def test_every_stage_keeps_the_fastest_by_the_maximum_over_the_stages(calibrated_sleep, kept):
    results = spawn(2, "test_measured_auto:choose_worker", calibrated_sleep, timeout=300)
    for rank, result in enumerate(results):
        pick = result["chosen"]["eager"]
        assert set(result["chosen"]) == {"eager"}  # no graphed labels: no graphed choice
        assert pick["kept"] == kept, (rank, pick)
        assert pick["added"][0] == "terapipe_calibrated"
        events = result["events"]
        added = events.index(("added", "terapipe_calibrated", True, False))
        assert events.index(("run", "terapipe_calibrated")) > added  # joined before it ran
    lines = results[0]["chosen"]["eager"]["lines"]
    assert results[1]["chosen"]["eager"]["lines"] == []  # rank 0 logs
    assert any(line.startswith("terapipe auto: trial terapipe_calibrated: ") for line in lines)
    assert lines[-1].startswith(f"terapipe auto: keeping {kept} (")


def _row(config, graphs, runs, order="1f1b"):
    return {"config": config, "graphs": graphs, "runs_s": runs,
            "measured_s": sorted(runs)[len(runs) // 2], "order": order}


def test_the_kept_row_against_the_rows_timed_alone():
    from measured_auto import auto_rows

    rows = [_row("megatron_1f1b", "none", [0.30, 0.30, 0.30], order=None),
            _row("terapipe_dp", "none", [0.20, 0.21, 0.22]),
            _row("terapipe_uniform", "none", [0.15, 0.15, 0.15]),
            _row("terapipe_dp+graphs", "terapipe", [0.10, 0.10, 0.10])]
    chosen = {"eager": {"kept": "terapipe_dp", "lines": ["l"]},
              "graphed": {"kept": "terapipe_dp+graphs", "lines": []}}
    eager, graphed = auto_rows("c", rows, chosen)
    assert (eager["way"], eager["fastest"]) == ("eager", "terapipe_uniform")
    assert eager["over_fastest"] == pytest.approx(0.21 / 0.15 - 1)
    assert eager["vs_megatron"] == pytest.approx(0.30 / 0.21)
    assert eager["trial_lines"] == ["l"]
    # the graphed way compares graphed rows only, and has no graphed Megatron row here
    assert (graphed["fastest"], graphed["over_fastest"], graphed["vs_megatron"]) == (
        "terapipe_dp+graphs", 0.0, None)


def test_the_host_joins_the_replanned_rows_as_the_stages_did():
    from measured_auto import join_added
    from megatron_terapipe.plan import TeraPipePlan

    plan = TeraPipePlan([512] * 4)
    speed = SimpleNamespace(plans={"megatron_1f1b": None}, graphed=("megatron_1f1b+graphs",))
    chosen = {"eager": {"added": None},
              "graphed": {"added": ("terapipe_calibrated+graphs", plan.to_dict())}}
    predicted = join_added(speed, chosen, lambda p: float(len(p.seq_slices)))
    assert predicted == {"terapipe_calibrated+graphs": 4.0}
    assert speed.plans["terapipe_calibrated+graphs"] == plan
    assert speed.graphed == ("megatron_1f1b+graphs", "terapipe_calibrated+graphs")


def test_the_replan_calibrates_on_the_trials_and_offers_the_dp_plan_for_its_way():
    from measured_auto import _replan
    from megatron_terapipe import TrialCandidate
    from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset
    from megatron_terapipe.plan import TeraPipePlan

    from harness import TinyGPT

    cost = AnalyticCostModel(model_preset("gpt3-1b"), hardware_preset("a100"),
                             layers_per_stage=6, tensor_parallel=2)
    case = SimpleNamespace(num_microbatches=1, model=TinyGPT(seq_length=2048), granularity=128,
                           cost=cost)
    measured = [(TrialCandidate("megatron_1f1b"), 0.30),
                (TrialCandidate("terapipe_dp", TeraPipePlan([1024, 1024])), 0.25),
                (TrialCandidate("terapipe_uniform", TeraPipePlan([512] * 4)), 0.22)]
    offered = _replan(case, 4, "graphed")(measured)
    assert offered.name == "terapipe_calibrated+graphs"
    assert sum(offered.plan.seq_slices) == 2048
    assert all(s % 128 == 0 for s in offered.plan.seq_slices)
    assert offered.predicted_s == offered.plan.predicted_time > 0
