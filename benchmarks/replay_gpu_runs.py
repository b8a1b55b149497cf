"""Every committed GPU pipeline and virtual-stage row re-simulated: as planned, with the host
floor, and with a calibration fitted on the run's other rows (leave one out).

    python benchmarks/replay_gpu_runs.py
    python benchmarks/replay_gpu_runs.py --out benchmarks/results/planner/replay_gpu_runs.json

Reads gpu/h100/pipeline.json, gpu/h200/pipeline.json and gpu/h100/virtual.json under
benchmarks/results/; nothing is timed here. A run is re-simulated from the layer profiles saved
inside it (results_layout.py) on the link it measured: bench_gpu_pipeline's rows through
resimulate_gpu_pipeline.case_rows (their plans rebuilt on the run's cost model, checked against
the rows), bench_gpu_virtual's from the plans the rows carry. A run without saved profiles
cannot be re-simulated: it is listed as skipped, with the reason. Per row:
1. "today": the simulator as it stands, on the cost model the run planned on;
2. "host floor": every compute action lasts at least its launches' host time, taken as what
   the profile's shortest cell costs (a wall-timed profile's short cells are host-bound);
3. "calibrated": (2) with a per-cell overhead and a scale (planner/evaluate/calibration.py)
   fitted on the OTHER rows of the same run that ran the same way (eager, or graphed: a run's
   trials share one), never on the row itself.
Per case and way of running, the DP's plan re-planned on a calibrated model against the
measured-fastest TeraPipe row (is it that row, or within 3%?): calibrated on the run's other
cases ("case held out"; none where the run has one case) and on all its rows of that way, the
case's included ("after trials", what `auto` would have after timing its shortlist); beside
it, the TeraPipe row the run's own prediction ranked fastest ("today"). A plan no row ran has
no measured time. Targets: every row within 15%, every choice within 3%.
Prints the tables; with --out writes them as JSON, its provenance first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from provenance import provenance, script_command  # noqa: E402
from resimulate_gpu_pipeline import case_rows, row_plan, run_link  # noqa: E402
from results_layout import RESULTS, load_runs, unpack_profiles  # noqa: E402

FILES = (("gpu/h100/pipeline.json", "pipeline"), ("gpu/h200/pipeline.json", "pipeline"),
         ("gpu/h100/virtual.json", "virtual"))
TOLERANCE, CHOICE_WITHIN = 0.15, 0.03
VARIANTS = ("today", "host_floor", "calibrated")


@dataclass
class Replayed:
    """One measured row and its schedule on the run's cost model (`trial`, with the floor)."""

    case: str
    config: str
    mode: str  # "eager" or "graphed"
    measured_s: float
    predicted_s_run: float  # what the run itself predicted
    trial: object  # calibration.Trial
    key: Optional[tuple]  # TeraPipe rows: (slices, order, chunks); Megatron's: None


@dataclass
class Case:
    """What re-planning a case needs: its cost model (the run's) and shape."""

    name: str
    kind: str  # "pipeline" or "virtual"
    cost: object
    model: object
    num_microbatches: int
    stages: int
    granularity: int
    cores: float  # as the run's rows were simulated
    floor: object  # simulator.HostFloor

    def predicted(self, plan, calibration) -> float:
        """`plan`'s simulated time here, with the floor and `calibration`."""
        from megatron_terapipe.planner.evaluate.calibration import Trial
        from megatron_terapipe.schedule import build_schedule

        schedule = build_schedule(plan, self.num_microbatches, self.stages, 1)
        trial = Trial(schedule, self.cost, 1.0, "choice", self.cores, self.floor)
        return trial.predicted(calibration.per_cell_s, calibration.scale)


def host_floor_of(cost):
    """The stage's time on the profile's shortest cell, per kind: its launches' host time."""
    from megatron_terapipe.planner.evaluate.simulator import HostFloor

    unit = float(cost.fit.measurements.length.min())
    return HostFloor(forward_s=cost.forward_time(1, unit, 0),
                     backward_s=cost.backward_time(1, unit, 0),
                     wgrad_s=cost.wgrad_time(1, unit, 0, False, False))


def plan_key(plan) -> tuple:
    return (tuple(plan.seq_slices), plan.order, plan.virtual_stages)


def pipeline_run(run: dict, folder: str) -> tuple[list[Replayed], list[Case]]:
    """bench_gpu_pipeline's rows: plans rebuilt (and checked) as resimulate_gpu_pipeline does."""
    import bench_gpu_pipeline as bench
    from pipeline_plans import megatron_1f1b_plan, plans_for, profile_cost_model
    from megatron_terapipe.planner.evaluate.calibration import Trial
    from megatron_terapipe.schedule import build_schedule

    command = run["provenance"]["command"]
    granularity = (int(command[command.index("--granularity") + 1])
                   if "--granularity" in command else 64)
    link, _ = run_link(run)
    replayed, cases = [], []
    for name in dict.fromkeys(r["case"] for r in run["rows"]):
        case_rows(folder, run, name, granularity, link)  # rebuilds the plans: as the rows say?
        case = next(c for suite in bench.SUITES.values() for c in suite if c.name == name)
        model = case.model(True)
        cost = profile_cost_model(model, granularity, case.layers_per_stage, "cuda",
                                  case.profile_cache(folder, "cuda"), "bfloat16", link=link)
        plans, _ = plans_for(cost, model, case.num_microbatches, granularity, case.stages)
        floor = host_floor_of(cost)
        cases.append(Case(name, "pipeline", cost, model, case.num_microbatches, case.stages,
                          granularity, float(case.stages), floor))
        for row in (r for r in run["rows"] if r["case"] == name):
            plan = row_plan(row, plans)
            schedule = build_schedule(megatron_1f1b_plan(model) if plan is None else plan,
                                      case.num_microbatches, case.stages, 1)
            trial = Trial(schedule, cost, row["measured_s"], f"{name} {row['config']}",
                          float(case.stages), floor)
            replayed.append(Replayed(name, row["config"],
                                     "eager" if row["graphs"] == "none" else "graphed",
                                     row["measured_s"], row["predicted_s"], trial,
                                     None if plan is None else plan_key(plan)))
    return replayed, cases


def virtual_run(run: dict, folder: str) -> tuple[list[Replayed], list[Case]]:
    """bench_gpu_virtual's rows: every schedule from the plan its row carries."""
    from bench_gpu_virtual import the_case
    from bench_virtual_cpu import STAGES
    from pipeline_plans import megatron_1f1b_plan, profile_cost_model
    from megatron_terapipe.plan import TeraPipePlan
    from megatron_terapipe.planner.evaluate.calibration import Trial
    from megatron_terapipe.schedule import build_interleaved_schedule, build_schedule

    setup = run["setup"]
    case = the_case(argparse.Namespace(smoke=setup["smoke"], seq_length=setup["seq_length"],
                                       microbatches=setup["num_microbatches"]))
    model, M = case.model(setup["bf16"]), setup["num_microbatches"]
    link, _ = run_link(run)
    cost = profile_cost_model(model, setup["granularity"], case.layers_per_stage, "cuda",
                              case.profile_cache(folder, "cuda"), "bfloat16", link=link)
    floor, shares = host_floor_of(cost), float(run["machine"]["stage_shares"])
    replayed = []
    for row in run["speed"]:
        plan = None if row["plan"] is None else TeraPipePlan.from_dict(row["plan"])
        if row["schedule"] == "megatron_interleaved":
            schedule = build_interleaved_schedule(model.seq_length, M, STAGES, row["chunks"], 1)
        else:
            schedule = build_schedule(plan or megatron_1f1b_plan(model), M, STAGES, 1)
        trial = Trial(schedule, cost, row["measured_s"], f"{case.name} {row['config']}", shares,
                      floor)
        replayed.append(Replayed(case.name, row["config"], "eager", row["measured_s"],
                                 row["predicted_s"], trial, plan and plan_key(plan)))
    return replayed, [Case(case.name, "virtual", cost, model, M, STAGES, setup["granularity"],
                           shares, floor)]


def replay_rows(replayed: list[Replayed]) -> list[dict]:
    """Each row's three predictions; the calibration fitted on the run's other rows run the
    same way."""
    from megatron_terapipe.planner.evaluate.calibration import fit_calibration

    out = []
    for r in replayed:
        others = [o.trial for o in replayed if o is not r and o.mode == r.mode]
        calibration = fit_calibration(others)
        predicted = {"today": replace(r.trial, host_floor=None).predicted(),
                     "host_floor": r.trial.predicted(),
                     "calibrated": r.trial.predicted(calibration.per_cell_s, calibration.scale)}
        out.append({"case": r.case, "config": r.config, "mode": r.mode,
                    "measured_s": r.measured_s, "predicted_s_run": r.predicted_s_run,
                    **{f"predicted_s_{v}": predicted[v] for v in VARIANTS},
                    **{f"error_{v}": predicted[v] / r.measured_s - 1 for v in VARIANTS},
                    "calibration": calibration.to_dict()})
    return out


def dp_choice(case: Case, calibration):
    """The plan the planner picks on the calibrated model: the DP's (bench_gpu_pipeline's
    plans_for), and on a virtual case the faster of it and the planner's plan on chunks."""
    from pipeline_plans import plans_for

    cost = calibration.apply(case.cost)
    plans, _ = plans_for(cost, case.model, case.num_microbatches, case.granularity, case.stages)
    best = plans["terapipe_dp"]
    if case.kind == "virtual":
        from bench_virtual_cpu import CHUNKS
        from virtual_cpu_plans import virtual_plan

        chunked, _ = virtual_plan(cost, case.model, case.num_microbatches, best, case.stages,
                                  CHUNKS)
        best = chunked if chunked.predicted_time < best.predicted_time else best
    return best


def calibrated_choice(case: Case, calibration, rows: list[Replayed], how: str) -> dict:
    """The calibrated planner's plan against the measured-fastest of `rows`, with both
    predicted under the calibration."""
    plan = dp_choice(case, calibration)
    fastest = min(rows, key=lambda r: r.measured_s)
    predicted = (case.predicted(plan, calibration),
                 fastest.trial.predicted(calibration.per_cell_s, calibration.scale))
    return choice_entry(plan_key(plan), rows, how, predicted)


def choice_entry(key: Optional[tuple], rows: list[Replayed], how: str,
                 predicted: tuple[float, float]) -> dict:
    """A choice against the measured-fastest TeraPipe row of `rows`; `predicted`: the choice's
    time and the fastest row's, as the choosing model predicts them."""
    fastest = min(rows, key=lambda r: r.measured_s)
    chosen = next((r for r in rows if r.key == key), None)
    entry = {"how": how, "plan": None if key is None else {
        "slices": list(key[0]), "order": key[1], "chunks": key[2]},
        "row": chosen and chosen.config, "fastest_row": fastest.config,
        "fastest_measured_s": fastest.measured_s, "predicted_s": predicted[0],
        "fastest_predicted_s": predicted[1]}
    if chosen is None:
        return {**entry, "measured_s": None, "over_fastest": None, "within": None}
    over = chosen.measured_s / fastest.measured_s - 1
    return {**entry, "measured_s": chosen.measured_s, "over_fastest": over,
            "within": over <= CHOICE_WITHIN}


def choices(replayed: list[Replayed], cases: list[Case]) -> list[dict]:
    """Per case and way of running: today's pick, and the calibrated DP's (case held out;
    after the trials)."""
    from megatron_terapipe.planner.evaluate.calibration import fit_calibration

    out = []
    for case in cases:
        for mode in dict.fromkeys(r.mode for r in replayed):
            rows = [r for r in replayed if r.case == case.name and r.mode == mode]
            terapipe = [r for r in rows if r.key is not None]
            if not terapipe:
                continue
            today = min(terapipe, key=lambda r: r.predicted_s_run)
            fastest = min(terapipe, key=lambda r: r.measured_s)
            entries = [choice_entry(today.key, terapipe, "today",
                                    (today.predicted_s_run, fastest.predicted_s_run))]
            held_out = [r.trial for r in replayed if r.mode == mode and r.case != case.name]
            if held_out:
                entries.append(calibrated_choice(case, fit_calibration(held_out), terapipe,
                                                 "case held out"))
            everything = [r.trial for r in replayed if r.mode == mode]
            entries.append(calibrated_choice(case, fit_calibration(everything), terapipe,
                                             "after trials"))
            out.append({"case": case.name, "mode": mode, "choices": entries})
    return out


def replay_file(path: str, kind: str) -> tuple[list[dict], list[dict]]:
    """(re-simulated runs, skipped runs) of one results file."""
    done, skipped = [], []
    for i, run in enumerate(load_runs(os.path.join(RESULTS, path))):
        where = {"file": path, "run": i, "measured": run["provenance"]["measured"],
                 "command": run["provenance"]["command"]}
        if not run.get("profiles"):
            skipped.append({**where, "reason": "the run saved no layer profiles inside it: "
                            "the cost model it planned on cannot be rebuilt"})
            continue
        folder = tempfile.mkdtemp(prefix="replay_gpu_runs_")
        unpack_profiles(run, folder)
        replayed, cases = (pipeline_run if kind == "pipeline" else virtual_run)(run, folder)
        done.append({**where, "link": run["link"], "rows": replay_rows(replayed),
                     "choices": choices(replayed, cases)})
    return done, skipped


def summary(runs: list[dict]) -> dict:
    rows = [r for run in runs for r in run["rows"]]
    out = {}
    for v in VARIANTS:
        errors = [abs(r[f"error_{v}"]) for r in rows]
        out[v] = {"rows": len(errors), "within_tolerance": sum(e <= TOLERANCE for e in errors),
                  "worst_abs_error": max(errors),
                  "mean_abs_error": sum(errors) / len(errors)}
    for how in ("today", "case held out", "after trials"):
        picks = [c for run in runs for case in run["choices"] for c in case["choices"]
                 if c["how"] == how]
        out["choice " + how] = {"cases": len(picks),
                                "within": sum(bool(c["within"]) for c in picks),
                                "not_measured": sum(c["within"] is None for c in picks)}
    return out


def print_tables(runs: list[dict], skipped: list[dict], totals: dict) -> None:
    for s in skipped:
        print(f"skipped {s['file']} run {s['run']} ({s['measured'][:10]}): {s['reason']}")
    print(f"\n{'case':<15} {'schedule':<26} {'measured':>8} {'today':>14} {'host floor':>14} "
          f"{'calibrated':>14}  {'LOO fit (ms/cell, scale)':>24}")
    for run in runs:
        print(f"-- {run['file']} run {run['run']} ({run['measured'][:10]})")
        for r in run["rows"]:
            cells = " ".join(f"{r['predicted_s_' + v] * 1e3:7.1f} {r['error_' + v]:+6.1%}"
                             for v in VARIANTS)
            c = r["calibration"]
            print(f"{r['case']:<15} {r['config']:<26} {r['measured_s'] * 1e3:8.1f} {cells}  "
                  f"{c['per_cell_s'] * 1e3:+13.2f}, {c['scale']:.3f}")
    print(f"\n{'case':<15} {'way':<8} {'choice':<14} {'plan':<26} {'row':<24} "
          f"{'measured vs fastest':>19} {'predicted vs fastest':>20}")
    for run in runs:
        for case in run["choices"]:
            for c in case["choices"]:
                p = c["plan"]
                plan = p and f"{p['order']} {p['slices']} V{p['chunks']}"
                over = "not run" if c["over_fastest"] is None else f"{c['over_fastest']:+.1%}"
                said = c["predicted_s"] / c["fastest_predicted_s"] - 1
                print(f"{case['case']:<15} {case['mode']:<8} {c['how']:<14} {plan!s:<26} "
                      f"{c['row'] or '-':<24} {over:>19} {said:>+20.1%}")
    print(f"\ntargets: every row within {TOLERANCE:.0%}; every choice within {CHOICE_WITHIN:.0%} "
          "of the measured-fastest TeraPipe row")
    print(json.dumps(totals, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here (e.g. "
                                 "benchmarks/results/planner/replay_gpu_runs.json)")
    args = p.parse_args(argv)
    origin = provenance(script_command(__file__, argv))
    runs, skipped = [], []
    for path, kind in FILES:
        done, left = replay_file(path, kind)
        runs += done
        skipped += left
    totals = summary(runs)
    print_tables(runs, skipped, totals)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"provenance": origin, "targets": {"row_within": TOLERANCE,
                                                          "choice_within": CHOICE_WITHIN},
                       "summary": totals, "skipped": skipped, "runs": runs}, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
