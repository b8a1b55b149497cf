"""TeraPipe on virtual pipeline stages against Megatron-Core's 1F1B and interleaved 1F1B, on CPU.

    python benchmarks/bench_virtual_cpu.py             # seq 2048, hidden 512, 4 microbatches, 7 rounds
    python benchmarks/bench_virtual_cpu.py --quick     # tiny model, 2 rounds: a smoke run
    python benchmarks/bench_virtual_cpu.py --rounds 9 --seq-length 4096 --microbatches 8
    python benchmarks/bench_virtual_cpu.py --limits 1.53 2   # the simulated no-bubble limit at
                                                             # these capacities; runs nothing

Two pipeline stages (2 processes, one thread each, each bound to its own core with
`pin_to_core`, as bench_schedules.py runs them), bench_schedules' model (4 layers, 8 heads,
vocab 1024), the same weights and batches in every row:
1. megatron_1f1b: Megatron-Core's forward_backward_pipelining_without_interleaving, one model
   chunk per stage (through `enable_cpu_mode`);
2. megatron_interleaved_v2: Megatron-Core's forward_backward_pipelining_with_interleaving on
   2 chunks per stage built as Megatron builds them (GPTModel(..., vp_stage=c));
3. terapipe_v1: TeraPipe on one chunk per stage with bench_schedules' plan (the DP plan from
   the cost model profiled here, the faster order: pipeline_plans.plans_for);
4. terapipe_v2: TeraPipe on the same 2 chunks per stage with the planner's plan
   (planner.search_virtual: slicing, group, warm-up and W places, both orders, no budget);
5. terapipe_v2_uniform: the best near-equal slicing on 2 chunks in that plan's order and W
   mode, with Megatron's default group and warm-up and W actions in their default places
   (left out where it is the planner's plan);
6. terapipe_v1_edges: TeraPipe on one chunk with edge slicing (whole sequences, the first and
   last microbatches cut, W placed: planner.edge_search's walk on the profile here), where
   there are at least 2 microbatches per stage;
7. terapipe_v2_in_a_v: TeraPipe on 2 chunks per stage in a V (Zero Bubble's ZB-V placement:
   rank k holds virtual stages k and 3 - k, the embedding and the loss on rank 0; chunks
   built by megatron_terapipe.v_chunk_roles / place_in_v) with the planner's V plan
   (search_virtual(..., placement="v"): slicing, warm-up and W places, both orders).
The plans come from virtual_cpu_plans.py.
Every row runs once to warm up (its losses checked against Megatron 1F1B's), then in `--rounds`
interleaved rounds, the order rotating every round; a row's speedup is the median over rounds
of Megatron 1F1B's time in the same round over its own (likewise against the interleaved
schedule). The simulator predicts every row from the same profiled cost model with the stages
sharing the measured parallel capacity (Megatron's interleaved 1F1B as the planner models it,
schedule/interleaved.py). That profile is measured in the rows' conditions (both stage
processes at once, pinned, medians, after two iterations of each Megatron schedule in the same
processes: `profile_in_run`); the predictions from a profile measured
alone (the fastest of 3 runs) are kept beside them
(`predicted_alone_profile_s`). The JSON (`--out`) starts with its provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
# The multi-process harness lives with the tests (the wheel does not ship it).
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402

from bench_schedules import parallel_capacity  # noqa: E402
from harness import TinyGPT, spawn  # noqa: E402
from pipeline_plans import megatron_1f1b_plan, plans_for, predict, profile_cost_model  # noqa: E402
from provenance import describe, provenance, script_command  # noqa: E402
from results_layout import default_out  # noqa: E402
from virtual_cpu_plans import (GRANULARITY, edge_plan, uniform_virtual_plan,  # noqa: E402
                               v_shape_plan, virtual_plan)
from virtual_runs_bench import (MEGATRON_1F1B, MEGATRON_INTERLEAVED, TERAPIPE, Row,  # noqa: E402
                                VirtualSpeedCase, loss_difference)

STAGES, CHUNKS = 2, 2
TARGET_OVER_1F1B = 1.20  # the measured target at 4 microbatches
SIMULATOR_TOLERANCE = 0.10
PROFILE_REPEATS = 5  # the in-run profile's runs per cell (their median)
WARM_ROUNDS = 2  # iterations of each Megatron schedule in the profiling processes first


def profile_in_run(model: TinyGPT, cache: str, M: int):
    """The simulator's profile, measured in the rows' conditions (virtual_runs_bench.
    profile_in_run_worker: both stage processes at once, pinned, CPU mode, medians, after
    WARM_ROUNDS iterations of Megatron's two schedules in the same processes): a profile
    measured alone, the fastest of 3 runs, puts every row 9-13% under its measured time, with
    the pipeline's cells 7-14% slower than it; one measured in fresh processes, 10-24%
    under."""
    paths = [cache.replace(".json", f"_in_run_rank{r}.json") for r in range(STAGES)]
    print(f"profiling it again in the rows' conditions ({STAGES} processes at once, after "
          f"{WARM_ROUNDS} rounds of Megatron's schedules, medians of {PROFILE_REPEATS}) ...",
          flush=True)
    warm = VirtualSpeedCase(model, M, WARM_ROUNDS, CHUNKS, [
        Row("megatron_1f1b", MEGATRON_1F1B), Row("megatron_interleaved", MEGATRON_INTERLEAVED,
                                                 CHUNKS)])
    spawn(STAGES, "virtual_runs_bench:profile_in_run_worker", model, GRANULARITY,
          model.num_layers // STAGES, paths, PROFILE_REPEATS, warm, timeout=1800)
    return profile_cost_model(model, GRANULARITY, model.num_layers // STAGES, "cpu", paths[0])


def check_interleaved_runs(model: TinyGPT, M: int) -> None:
    """Megatron's own conditions on its interleaved schedule, before any process starts (the
    in-run profile runs it first)."""
    from megatron_terapipe.schedule import build_interleaved_schedule

    try:
        build_interleaved_schedule(model.seq_length, M, STAGES, CHUNKS, 1)
    except ValueError as exc:
        raise SystemExit(f"--microbatches {M}: Megatron's interleaved 1F1B cannot run it ({exc})")


def make_rows(cost, model: TinyGPT, M: int) -> tuple[list[Row], dict]:
    """The timed rows and what the planners said on the way."""
    check_interleaved_runs(model, M)
    plans, info = plans_for(cost, model, M, GRANULARITY, STAGES)
    planned, timed = virtual_plan(cost, model, M, plans["terapipe_dp"], STAGES, CHUNKS)
    uniform = uniform_virtual_plan(cost, model, M, planned, STAGES, CHUNKS)
    rows = [Row("megatron_1f1b", MEGATRON_1F1B),
            Row(f"megatron_interleaved_v{CHUNKS}", MEGATRON_INTERLEAVED, CHUNKS),
            Row("terapipe_v1", TERAPIPE, 1, plans["terapipe_dp"]),
            Row(f"terapipe_v{CHUNKS}", TERAPIPE, CHUNKS, planned)]
    same = replace(uniform, predicted_time=None) == replace(planned, predicted_time=None)
    if not same:
        rows.append(Row(f"terapipe_v{CHUNKS}_uniform", TERAPIPE, CHUNKS, uniform))
    edges = edge_plan(cost, model, M, STAGES)
    if edges is not None:
        rows.append(Row("terapipe_v1_edges", TERAPIPE, 1, edges))
    rows.append(Row(f"terapipe_v{CHUNKS}_in_a_v", TERAPIPE, CHUNKS,
                    v_shape_plan(cost, model, M, STAGES)))
    notes = {"one_chunk_plan": info, "virtual_search_timed": timed,
             "uniform_v2_is_the_planned_plan": same}
    return rows, notes


def predicted(cost, row: Row, model: TinyGPT, M: int, cores: float) -> float:
    """The simulator's iteration time for `row` with the stages sharing `cores` cores."""
    if row.schedule == MEGATRON_INTERLEAVED:
        from megatron_terapipe.planner import simulate
        from megatron_terapipe.schedule import build_interleaved_schedule

        schedule = build_interleaved_schedule(model.seq_length, M, STAGES, row.chunks, 1)
        return simulate(schedule, cost, cores=cores, megatron=True).iteration_time
    return predict(cost, row.plan, model, M, cores, STAGES)


def simulated_busy(cost, row: Row, M: int) -> list[float]:
    """Each stage's compute seconds in the simulator for a TeraPipe row's plan (beside the
    measured `stage_busy_s`: how far the profile is from the cells as they ran)."""
    from megatron_terapipe.planner import simulate
    from megatron_terapipe.schedule import build_schedule

    return list(simulate(build_schedule(row.plan, M, STAGES, 1), cost).busy)


def plan_text(row: Row) -> str:
    if row.plan is None:
        return "whole sequences"
    from megatron_terapipe.planner.schedule_choice import plan_note

    return f"{row.plan.order} {plan_note(row.plan)}"


def result_rows(rows: list[Row], per_rank: list[dict], cost, model: TinyGPT, M: int,
                capacity: float, cost_alone=None) -> list[dict]:
    """Per row: the measured times (each round's slower stage), ratios per round, predictions
    (from `cost`, and from `cost_alone`, a profile measured alone, when given)."""
    rounds = len(per_rank[0][rows[0].label])
    runs = {r.label: [max(p[r.label][i] for p in per_rank) for i in range(rounds)] for r in rows}
    # each row's losses from the rank that reports them (the last; rank 0 in a V)
    losses = {key: next(p[key] for p in per_rank if p[key] is not None)
              for key in per_rank[0] if key.startswith("losses:")}
    base, interleaved = runs[rows[0].label], runs[rows[1].label]
    out = []
    for row in rows:
        times = runs[row.label]
        measured = statistics.median(times)
        sim = predicted(cost, row, model, M, capacity)
        out.append({
            "config": row.label, "schedule": row.schedule, "chunks": row.chunks,
            "plan": None if row.plan is None else row.plan.to_dict(), "plan_text": plan_text(row),
            "measured_s": measured, "runs_s": times,
            "speedup_vs_megatron_1f1b": statistics.median(b / t for b, t in zip(base, times)),
            "speedup_vs_megatron_interleaved": statistics.median(
                i / t for i, t in zip(interleaved, times)),
            "predicted_s": sim, "predicted_over_measured": sim / measured,
            "predicted_dedicated_s": predicted(cost, row, model, M, float(STAGES)),
            "predicted_alone_profile_s": (None if cost_alone is None else
                                          predicted(cost_alone, row, model, M, capacity)),
            "stage_busy_s": ([statistics.median(p["busy:" + row.label]) for p in per_rank]
                             if row.schedule == TERAPIPE else None),
            "stage_busy_simulated_s": (simulated_busy(cost, row, M)
                                       if row.schedule == TERAPIPE else None),
            "loss_rel_diff_vs_megatron_1f1b": loss_difference(
                losses["losses:" + row.label], losses["losses:" + rows[0].label]),
        })
    return out


def bubble_free_limit(cost, model: TinyGPT, M: int, capacity: float) -> float:
    """What a schedule with no bubble at all could gain over Megatron 1F1B on this machine,
    simulated: 1F1B's time with the stages sharing `capacity` cores over the longer of the
    busiest stage's compute and all stages' compute spread over `capacity` cores. Below 2
    cores' worth a waiting stage lends the other its share, so bubbles cost less than on
    dedicated processors and the limit sits below (M + K - 1) / M."""
    from megatron_terapipe.planner import simulate
    from megatron_terapipe.schedule import build_schedule

    busy = simulate(build_schedule(megatron_1f1b_plan(model), M, STAGES, 1), cost).busy
    return predict(cost, None, model, M, capacity, STAGES) / max(max(busy), sum(busy) / capacity)


def targets(rows: list[dict], limit: float) -> dict:
    """Issue 34's measured targets, read off this run's rows, and the simulated limit."""
    best = max((r for r in rows if r["schedule"] == TERAPIPE and r["chunks"] > 1),
               key=lambda r: r["speedup_vs_megatron_1f1b"])
    return {"best_terapipe_virtual": best["config"],
            "speedup_vs_megatron_1f1b": best["speedup_vs_megatron_1f1b"],
            "target_speedup_vs_megatron_1f1b": TARGET_OVER_1F1B,
            "bubble_free_limit_here_simulated": limit,
            "speedup_met": best["speedup_vs_megatron_1f1b"] >= TARGET_OVER_1F1B,
            "speedup_vs_megatron_interleaved": best["speedup_vs_megatron_interleaved"],
            "faster_than_megatron_interleaved": best["speedup_vs_megatron_interleaved"] > 1.0,
            "simulator_tolerance": SIMULATOR_TOLERANCE,
            "simulator_within_tolerance": all(
                abs(r["predicted_over_measured"] - 1.0) <= SIMULATOR_TOLERANCE for r in rows)}


def print_table(rows: list[dict], capacity: float, unit: str = "cores") -> None:
    print("\n(measured: median of the rounds, each round's slower stage; vs 1F1B / vs interl.: "
          "median over rounds of that Megatron row's time in the same round over this row's; "
          f"simulated: the stages sharing {capacity:.2f} {unit})")
    print(f"{'row':<26} {'V':>2} {'plan':<34} {'measured s':>10} {'simulated s':>11} "
          f"{'sim/meas':>8} {'alone/meas':>10} {'vs 1F1B':>8} {'vs interl.':>10} {'loss diff':>9}")
    for r in rows:
        print(f"{r['config']:<26} {r['chunks']:>2} {r['plan_text'][:34]:<34} "
              f"{r['measured_s']:>10.3f} {r['predicted_s']:>11.3f} "
              f"{r['predicted_over_measured']:>8.3f} "
              f"{_ratio(r['predicted_alone_profile_s'], r['measured_s']):>10} "
              f"{r['speedup_vs_megatron_1f1b']:>7.3f}x "
              f"{r['speedup_vs_megatron_interleaved']:>9.3f}x "
              f"{r['loss_rel_diff_vs_megatron_1f1b']:>9.1e}")


def _ratio(predicted_s, measured_s) -> str:
    return "-" if predicted_s is None else f"{predicted_s / measured_s:.3f}"


def print_headline(goal: dict, M: int) -> None:
    print(f"headline: {goal['best_terapipe_virtual']}, {M} microbatches: "
          f"{goal['speedup_vs_megatron_1f1b']:.3f}x over Megatron 1F1B (target "
          f"{goal['target_speedup_vs_megatron_1f1b']:.2f}x: "
          f"{'met' if goal['speedup_met'] else 'NOT met'}; a schedule with no bubble: "
          f"{goal['bubble_free_limit_here_simulated']:.3f}x on this machine, simulated), "
          f"{goal['speedup_vs_megatron_interleaved']:.3f}x over Megatron interleaved "
          f"({'faster' if goal['faster_than_megatron_interleaved'] else 'NOT faster'}); "
          f"simulator within {goal['simulator_tolerance']:.0%} of every row: "
          f"{'yes' if goal['simulator_within_tolerance'] else 'NO'}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny model (seq 512, hidden 256), 2 rounds: a smoke run")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7; 2 with --quick)")
    p.add_argument("--seq-length", type=int, default=None, help="default 2048 (512 with --quick)")
    p.add_argument("--hidden-size", type=int, default=None, help="default 512 (256 with --quick)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--limits", type=float, nargs="+", default=None, metavar="CORES",
                   help="only print bubble_free_limit at these parallel capacities, from the "
                        "layer profile beside --out (profiled first if absent)")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/cpu/"
                                               "virtual.json; with --quick, a scratch folder's)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.seq_length = args.seq_length or (512 if args.quick else 2048)
    args.hidden_size = args.hidden_size or (256 if args.quick else 512)
    args.out = args.out or default_out("virtual_quick.json" if args.quick else "virtual.json",
                                       "cpu", scratch=args.quick)
    if args.rounds < 1 or args.microbatches < 1:
        p.error("--rounds and --microbatches must be at least 1")
    if args.seq_length % GRANULARITY:
        p.error(f"--seq-length {args.seq_length}: a multiple of {GRANULARITY} (the slicing unit)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    origin = provenance(script_command(__file__, argv))
    print(f"machine: {describe(origin)}", flush=True)
    started = time.perf_counter()
    torch.set_num_threads(1)  # stages run one thread each: profile with one thread too
    model = TinyGPT(num_layers=2 * STAGES, hidden_size=args.hidden_size, num_attention_heads=8,
                    vocab_size=1024, seq_length=args.seq_length)
    M = args.microbatches
    if not args.limits:  # the rows run Megatron's interleaved schedule
        check_interleaved_runs(model, M)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    cache = os.path.join(os.path.dirname(args.out),
                         f"profile_cpu_h{model.hidden_size}_s{model.seq_length}.json")
    print(f"profiling one layer (hidden {model.hidden_size}, seq {model.seq_length}) alone "
          "...", flush=True)
    cost_alone = profile_cost_model(model, GRANULARITY, model.num_layers // STAGES, "cpu", cache)
    if args.limits:
        for cores in args.limits:
            print(f"a schedule with no bubble, {M} microbatches, {cores:.2f} cores' worth: "
                  f"{bubble_free_limit(cost_alone, model, M, cores):.3f}x over Megatron 1F1B "
                  "(simulated)")
        return 0
    cost = profile_in_run(model, cache, M)
    capacity = parallel_capacity(hidden=args.hidden_size, tokens=args.seq_length)
    print(f"two single-thread processes get {capacity:.2f} cores' worth of compute", flush=True)
    rows, notes = make_rows(cost, model, M)
    for row in rows:
        print(f"  {row.label}: {plan_text(row)}", flush=True)
    print(f"running {len(rows)} rows in {args.rounds} interleaved rounds ...", flush=True)
    case = VirtualSpeedCase(model, M, args.rounds, CHUNKS, rows)
    per_rank = spawn(STAGES, "virtual_runs_bench:virtual_speed_worker", case, timeout=3600)
    speed = result_rows(rows, per_rank, cost, model, M, capacity, cost_alone)
    goal = targets(speed, bubble_free_limit(cost, model, M, capacity))
    results = {"provenance": origin,
               "setup": {"stages": STAGES, "chunks": CHUNKS, "num_microbatches": M,
                         "rounds": args.rounds, "quick": args.quick,
                         "seq_length": model.seq_length, "hidden_size": model.hidden_size,
                         "num_layers": model.num_layers, "num_attention_heads": 8,
                         "vocab_size": model.vocab_size, "granularity": GRANULARITY},
               "machine": {"device": "cpu", "parallel_capacity": capacity},
               "speed": speed, "targets": goal, "planning": notes,
               "wall_seconds": time.perf_counter() - started}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print_table(speed, capacity)
    print(f"wrote {os.path.relpath(args.out)} in {results['wall_seconds']:.0f} s")
    print_headline(goal, M)
    return 0


if __name__ == "__main__":
    sys.exit(main())
