"""Measured `auto` beside the rows it chooses among: the shortlist a pipeline benchmark times
alone, tried by a MeasuredChoice (megatron_terapipe.MeasuredChoice, what
`--pipeline-schedule auto` runs) on the same stage processes, and its pick held against the
rows' own medians.

`choose_in_stages` runs on every stage process after the rows' warm-ups and before their
timed rounds: per way of running (eager; graphed), a MeasuredChoice among that way's labels
(Megatron's row included) runs training iterations until it keeps one; each iteration is the
label's own (pipeline_runs._runner), so the trials cost what the rows cost. An iteration's time
is its maximum over the stages (over a gloo group: NCCL refuses two ranks on one GPU). After
the first rounds, as `auto` does, the cost model is calibrated on the trials' medians
(planner/evaluate/calibration.py) and the DP re-plans on it (pipeline_plans.plans_for); a plan
none of the rows has joins the trials as "terapipe_calibrated" (with "+graphs" when graphed)
and the timed rounds as a row of its own, so that the calibrated planner's choice is measured.
`auto_rows` then sets the kept label against the rows timed alone in the interleaved rounds:
its median over the fastest candidate's ("over_fastest"; the target is within 3%) and
Megatron's over it ("vs_megatron").
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional


CALIBRATED = "terapipe_calibrated"


def choose_in_stages(case, stages: int, run: Callable[[str], None], add_label: Callable,
                     zero_grads: Callable[[], None], group) -> dict:
    """{way: {"kept": label, "lines": rank 0's log lines, "added": the calibrated plan's label
    and plan dict, or None}} for each way of running of `case` (a SpeedCase). `run(label)`:
    one iteration of the label; `add_label(label, plan, graphed)`: the calibrated plan joins
    the rows, before its first trial."""
    labels = list(case.plans)
    ways = {"eager": [label for label in labels if label not in case.graphed],
            "graphed": [label for label in labels if label in case.graphed]}
    return {way: _choose(case, stages, way, names, (run, add_label, zero_grads), group)
            for way, names in ways.items() if len(names) > 1}


def _replan(case, stages: int, way: str):
    """MeasuredChoice's replan for the bench: calibrate `case.cost` on the trials' medians and
    offer the DP's plan on the calibrated model, labelled for `way`."""
    from megatron_terapipe import TrialCandidate
    from megatron_terapipe.planner.evaluate.calibration import Trial, fit_calibration
    from megatron_terapipe.schedule import build_schedule
    from pipeline_plans import megatron_1f1b_plan, plans_for

    def replan(measured):
        M = case.num_microbatches
        trials = [Trial(build_schedule(c.plan or megatron_1f1b_plan(case.model), M, stages, 1),
                        case.cost, seconds, c.name, float(stages)) for c, seconds in measured]
        calibration = fit_calibration(trials)
        plans, _ = plans_for(calibration.apply(case.cost), case.model, M, case.granularity,
                             stages)
        plan = plans["terapipe_dp"]
        label = CALIBRATED + ("+graphs" if way == "graphed" else "")
        return TrialCandidate(label, plan, plan.predicted_time)

    return replan


def _choose(case, stages: int, way: str, labels: list[str], calls: tuple, group) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_terapipe import MeasuredChoice, TrialCandidate

    def reduce_max(seconds: float) -> float:
        box = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
        return float(box.item())

    run, add_label, zero_grads = calls
    lines: list[str] = []
    replan = None if case.cost is None else _replan(case, stages, way)
    choice = MeasuredChoice([TrialCandidate(label, case.plans[label], case.predicted.get(label))
                             for label in labels], case.auto_trials, log=lines.append,
                            reduce_max=reduce_max, replan=replan)

    def this_iteration(**_) -> None:
        label = choice.last_run  # the candidate MeasuredChoice runs in this iteration
        if label not in case.plans:  # the calibrated plan: a row of its own from now on
            add_label(label, next(c.plan for c in choice.candidates if c.name == label),
                      way == "graphed")
        run(label)

    forward_backward = choice.wrap(this_iteration, this_iteration)
    while choice.kept is None:
        zero_grads()
        forward_backward()
    added = next((c for c in choice.candidates if c.name not in labels), None)
    return {"kept": choice.kept.name, "lines": lines,
            "added": added and (added.name, added.plan.to_dict())}


def auto_rows(case: str, rows: list[dict], chosen: dict) -> list[dict]:
    """Per way of running: the kept label's row against the fastest row and Megatron's."""
    out = []
    for way, pick in chosen.items():
        mine = [r for r in rows if (r["graphs"] == "none") == (way == "eager")]
        kept = next(r for r in mine if r["config"] == pick["kept"])
        fastest = min(mine, key=lambda r: r["measured_s"])
        megatron: Optional[dict] = next((r for r in mine if r["order"] is None), None)
        out.append({"case": case, "way": way, "kept": pick["kept"],
                    "fastest": fastest["config"],
                    "over_fastest": kept["measured_s"] / fastest["measured_s"] - 1.0,
                    "vs_megatron": (None if megatron is None else statistics.median(
                        m / t for m, t in zip(megatron["runs_s"], kept["runs_s"]))),
                    "trial_lines": pick["lines"]})
    return out


def print_auto(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\n{'case':<20} {'way':<8} {'auto kept':<28} {'fastest alone':<28} "
          f"{'kept over fastest':>17} {'vs 1F1B':>8}")
    for r in rows:
        ratio = "-" if r["vs_megatron"] is None else f"{r['vs_megatron']:.2f}x"
        print(f"{r['case']:<20} {r['way']:<8} {r['kept']:<28} {r['fastest']:<28} "
              f"{r['over_fastest']:>+16.1%} {ratio:>8}")
    print("(auto: a MeasuredChoice among the way's rows, run before the rounds; its pick's median "
          "in the rounds over the fastest row's, each timed alone)")


def join_added(speed, chosen: dict, predict_plan: Callable) -> dict:
    """The host's copy of what auto's re-planning added in the stages: each added label's plan
    into `speed` (a SpeedCase; graphed when its way was), and {label: predicted seconds}."""
    from megatron_terapipe.plan import TeraPipePlan

    predicted = {}
    for way, pick in chosen.items():
        if pick.get("added"):
            label, data = pick["added"]
            speed.plans[label] = plan = TeraPipePlan.from_dict(data)
            speed.graphed = (*speed.graphed, label) if way == "graphed" else speed.graphed
            predicted[label] = predict_plan(plan)
    return predicted
