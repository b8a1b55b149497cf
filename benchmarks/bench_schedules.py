"""TeraPipe against Megatron-Core's own 1F1B schedule, side by side in one process tree.

    python benchmarks/bench_schedules.py                # the full suite (CPU, ~6 min)
    python benchmarks/bench_schedules.py --repeats 3    # the suite 3 times: every run and medians
    python benchmarks/bench_schedules.py --quick        # smaller model, fewer rounds
    python benchmarks/bench_schedules.py --device cuda  # the same suite on 2 GPUs (NCCL)

What it measures, on 2 pipeline stages (2 processes, one thread each on CPU, each bound to its
own core with `pin_to_core`, as each rank has its own GPU on GPUs):
1. parallel capacity: how many cores' worth of compute two processes really get here;
2. speed: Megatron-Core's `forward_backward_pipelining_without_interleaving` (through
   `enable_cpu_mode` on CPU), TeraPipe with the DP plan from a cost model profiled on this
   device (deferred weight gradients and refinement as `solve` decides), and TeraPipe with the
   best uniform slicing in the same weight-gradient mode; 1 and 4 microbatches, plus a long
   sequence case; 7 interleaved rounds (the order rotating from round to round) so machine
   noise hits every configuration alike, and
   speedups as the median over rounds of the ratio to Megatron's run in the same round;
3. memory: peak saved activation + K/V bytes per stage with 8 microbatches (TeraPipe gpipe,
   TeraPipe 1f1b, Megatron 1F1B);
4. planner: solver time at bench_planner.py's three sizes;
5. fidelity: the simulator's predicted iteration time (same cost model, same schedule, stages
   sharing the measured parallel capacity) against each measured time. The cost model has the
   layer profile plus the first stage's embedding and the last stage's output layer and loss.
It writes a JSON of results (its provenance first: benchmarks/provenance.py) to --out, by
default benchmarks/results/cpu/schedules.json (replaced; a --quick run's goes to a scratch
folder), a PNG chart with --chart, and prints a table whose last line is the headline.
`--repeats N` runs parts 1, 2 and 5 N times (each run measures the parallel capacity again and
times every row in its own interleaved rounds); the JSON keeps every run ("runs") and, per
row, the median over the runs of its ratio to Megatron and of its measured time ("speed", with
each run's values beside them). The memory peaks (bytes, the same every run) and the planner's
times (best of 3) are taken once.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The multi-process harness lives with the tests (the wheel does not ship it).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

from megatron_terapipe.plan import TeraPipePlan  # noqa: E402
from harness import TinyGPT, spawn  # noqa: E402
from pipeline_runs import SpeedCase  # noqa: E402
from pipeline_plans import plans_for, predict, profile_cost_model  # noqa: E402
from provenance import describe, provenance, script_command  # noqa: E402
from results_layout import default_out, output_paths  # noqa: E402

STAGES = 2


# ---------------------------------------------------------------------------------------------
# 1. Parallel capacity of this machine
# ---------------------------------------------------------------------------------------------
def _mlp_seconds(queue, tokens: int, hidden: int, loops: int, index: int, count: int) -> None:
    """A transformer MLP's forward and backward: the GEMMs and activation traffic of a stage."""
    from megatron_terapipe.megatron.platform.cpu_mode import pin_to_core

    torch.set_num_threads(1)
    pin_to_core(index, count)  # as the stages are
    w1 = torch.randn(hidden, 4 * hidden, requires_grad=True)
    w2 = torch.randn(4 * hidden, hidden, requires_grad=True)

    def step() -> None:
        x = torch.randn(tokens, hidden, requires_grad=True)
        (torch.nn.functional.gelu(x @ w1) @ w2).sum().backward()

    step()
    start = time.perf_counter()
    for _ in range(loops):
        step()
    queue.put(time.perf_counter() - start)


def parallel_capacity(processes: int = STAGES, tokens: int = 2048, hidden: int = 512,
                      loops: int = 6) -> float:
    """Cores' worth of throughput `processes` single-threaded processes get at once, on a
    stage-like workload (shared caches and memory bandwidth count, not just the FPUs)."""
    ctx = mp.get_context("spawn")

    def run(n: int) -> float:
        queue = ctx.Queue()
        procs = [ctx.Process(target=_mlp_seconds, args=(queue, tokens, hidden, loops, i, n))
                 for i in range(n)]
        for p in procs:
            p.start()
        times = [queue.get() for _ in procs]
        for p in procs:
            p.join()
        return max(times)

    alone = min(run(1) for _ in range(2))
    together = min(run(processes) for _ in range(2))
    return processes * alone / together


# ---------------------------------------------------------------------------------------------
# 2. Speed: pipeline_runs.py (shared with bench_gpu_pipeline.py)

# ---------------------------------------------------------------------------------------------
# 3-4. Memory and planner
# ---------------------------------------------------------------------------------------------
def memory_table(model: TinyGPT, plan: TeraPipePlan, num_microbatches: int) -> dict:
    plans = {"terapipe_gpipe": TeraPipePlan(plan.seq_slices, order="gpipe"),
             "terapipe_1f1b": TeraPipePlan(plan.seq_slices, order="1f1b")}
    peaks = spawn(STAGES, "harness:measure_peak_activations", model, plans,
                  num_microbatches, 1, True, timeout=1800)
    return {name: [p[name] for p in peaks] for name in ("terapipe_gpipe", "terapipe_1f1b", "megatron_1f1b")}


def planner_times(repeats: int) -> list[dict]:
    """The DP slicer's best-of-`repeats` time on bench_planner's first three cases."""
    from bench_planner import CASES, _cost
    from megatron_terapipe.planner import solve_slicing

    out = []
    for model, layers, tp, seq, gran, rows, stages, target in CASES[:3]:
        cost = _cost(model, layers, tp)
        seconds = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            solve_slicing(cost, seq, rows, stages, granularity=gran)
            seconds = min(seconds, time.perf_counter() - started)
        out.append({"seq": seq, "granularity": gran, "rows": rows, "stages": stages,
                    "seconds": seconds, "target": target})
    return out


# ---------------------------------------------------------------------------------------------
def chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["speed"]
    labels = [f"{r['case']}\n{r['config']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 1.1), 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["measured_s"] for r in rows], width=0.4, label="measured (median)")
    ax.bar([i + 0.2 for i in x], [r["predicted_s"] for r in rows], width=0.4, label="simulator")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("seconds per iteration")
    runs = results["setup"]["suite_runs"]
    ax.set_title(f"2-stage pipeline on {results['machine']['device']} "
                 f"(parallel capacity {results['machine']['parallel_capacity']:.2f} cores)"
                 + (f", medians of {runs} suite runs" if runs > 1 else ""))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def speed_rows_for(args, rounds: int, quick: bool, capacity: float) -> list[dict]:
    """Measured and simulated rows of the three speed cases, with speedups per round."""
    base = TinyGPT(num_layers=2 * STAGES, hidden_size=256 if quick else 512,
                   num_attention_heads=8, vocab_size=1024, seq_length=512 if quick else 2048)
    long = TinyGPT(num_layers=STAGES, hidden_size=256, num_attention_heads=4, vocab_size=1024,
                   seq_length=1024 if quick else 8192)
    cases = [("seq%d_M1" % base.seq_length, base, 1, 64), ("seq%d_M4" % base.seq_length, base, 4, 64),
             ("long_seq%d_M1" % long.seq_length, long, 1, 64)]
    speed_rows = []
    cost_models = {}
    for name, model, M, gran in cases:
        key = (model.hidden_size, model.seq_length)
        if key not in cost_models:
            print(f"profiling one layer (hidden {model.hidden_size}, seq {model.seq_length}) ...", flush=True)
            cache = os.path.join(args.folder, f"profile_{args.device}_h{model.hidden_size}"
                                 f"_s{model.seq_length}.json")
            cost_models[key] = profile_cost_model(model, gran, model.num_layers // STAGES,
                                                  args.device, cache)
        cost = cost_models[key]
        plans, info = plans_for(cost, model, M, gran, STAGES)
        print(f"{name}: DP plan {info['dp_order']} {info['dp_slices']} (deferred weight "
              f"gradients: {info['dp_defer_wgrad']}, early W {info['dp_wgrad_points']}); best "
              f"uniform {info['uniform_slices']} slices (deferred: {info['uniform_defer_wgrad']}, "
              f"early W {info['uniform_wgrad_points']}); running {rounds} interleaved rounds ...",
              flush=True)
        case = SpeedCase(name, model, M, gran, rounds, plans)
        per_rank = spawn(STAGES, "pipeline_runs:speed_worker", case, args.device, timeout=3600)
        for label, plan in plans.items():
            runs = [max(r[label][i] for r in per_rank) for i in range(rounds)]
            busy = (None if plan is None else
                    [statistics.median(r["busy:" + label]) for r in per_rank])
            speed_rows.append({
                "case": name, "config": label, "num_microbatches": M,
                "slices": None if plan is None else [list(t) for t in plan.token_slices],
                "order": None if plan is None else plan.order,
                "defer_wgrad": None if plan is None else plan.defer_wgrad,
                "wgrad_points": None if plan is None else [list(p) for p in plan.wgrad_points],
                "measured_s": statistics.median(runs), "runs_s": runs,
                "stage_busy_s": busy,
                "predicted_s": predict(cost, plan, model, M, capacity, STAGES),
                "predicted_dedicated_s": predict(cost, plan, model, M, float(STAGES), STAGES),
            })
    # Speedups pair each run with Megatron's run of the same interleaved round (machine noise
    # drifts slowly, so a round's runs share it), then take the median over rounds.
    mega = {r["case"]: r["runs_s"] for r in speed_rows if r["config"] == "megatron_1f1b"}
    for r in speed_rows:
        r["speedup_vs_megatron"] = statistics.median(
            m / t for m, t in zip(mega[r["case"]], r["runs_s"]))
        r["fidelity_error"] = r["predicted_s"] / r["measured_s"] - 1.0

    return speed_rows


#: Per-row numbers a suite run gives; with several runs each becomes their median, with every
#: run's value beside it (key + "_per_run").
PER_RUN = ("measured_s", "speedup_vs_megatron", "predicted_s", "predicted_dedicated_s",
           "fidelity_error")
PLAN_KEYS = ("slices", "order", "defer_wgrad", "wgrad_points")


def median_rows(runs: list[dict]) -> list[dict]:
    """One row per (case, config) over the suite runs: the medians, every run's values, each
    stage's median busy time, and whether every run timed the same plan."""
    summary = []
    for first in runs[0]["speed"]:
        same = [next(r for r in run["speed"]
                     if (r["case"], r["config"]) == (first["case"], first["config"]))
                for run in runs]
        row = {k: first[k] for k in ("case", "config", "num_microbatches", *PLAN_KEYS)}
        row["same_plan_every_run"] = all(all(r[k] == first[k] for k in PLAN_KEYS) for r in same)
        for key in PER_RUN:
            row[key + "_per_run"] = [r[key] for r in same]
            row[key] = statistics.median(row[key + "_per_run"])
        busy = [r["stage_busy_s"] for r in same]
        row["stage_busy_s"] = (None if busy[0] is None else
                               [statistics.median(b[k] for b in busy) for k in range(len(busy[0]))])
        summary.append(row)
    return summary


def suite_run(args, rounds: int, quick: bool, index: int) -> dict:
    """One run of parts 1, 2 and 5: the parallel capacity, then every speed row."""
    print(f"suite run {index + 1} of {args.repeats}", flush=True)
    capacity = (parallel_capacity(hidden=256 if quick else 512, tokens=512 if quick else 2048)
                if args.device == "cpu" else float(STAGES))
    print(f"  two single-thread processes get {capacity:.2f} cores' worth of compute "
          f"(pipeline limit here: {min(capacity, STAGES):.2f}x)", flush=True)
    return {"parallel_capacity": capacity, "speed": speed_rows_for(args, rounds, quick, capacity)}


def print_speed(speed_rows: list[dict], suite_runs: int) -> None:
    print()
    print("(slices: token slices per microbatch; +W: weight gradients deferred to W actions; "
          "+We: with early W actions; measured: median of the rounds; vs Megatron: median over rounds of the ratio to "
          "Megatron's run in the same round"
          + (f"; every number the median of {suite_runs} suite runs, vs Megatron per run on the right)"
             if suite_runs > 1 else ")"))
    print(f"{'case':<18} {'schedule':<18} {'slices':>6} {'measured s':>10} {'simulated s':>11} "
          f"{'sim err':>7} {'vs Megatron':>11} {'stage busy s':>13}" + ("  per run" if suite_runs > 1 else ""))
    for r in speed_rows:
        n = "-" if r["slices"] is None else (str(sum(len(t) for t in r["slices"]))
                                             + ("+W" if r["defer_wgrad"] else "")
                                             + ("e" if r["wgrad_points"] else ""))
        busy = "" if r["stage_busy_s"] is None else " / ".join(f"{b:.3f}" for b in r["stage_busy_s"])
        per_run = ("  " + " ".join(f"{x:.3f}x" for x in r["speedup_vs_megatron_per_run"])
                   if suite_runs > 1 else "")
        print(f"{r['case']:<18} {r['config']:<18} {n:>6} {r['measured_s']:>10.3f} "
              f"{r['predicted_s']:>11.3f} {r['fidelity_error']:>+6.1%} {r['speedup_vs_megatron']:>10.2f}x "
              f"{busy:>13}{per_run}" + ("" if r["same_plan_every_run"] else "  (plans differed between runs)"))
    print("(stage busy: the median over rounds of each stage's summed cell spans; an iteration "
          "cannot be shorter than its busiest stage)")


def print_memory_and_planner(memory: dict, mem_model: TinyGPT, planner: list[dict]) -> None:
    print(f"\nactivation + K/V peak per stage (MiB), 8 microbatches, seq {mem_model.seq_length}:")
    for name, peaks in memory.items():
        print(f"  {name:<16} " + "  ".join(f"stage {k}: {b / 2**20:8.1f}" for k, b in enumerate(peaks)))
    ratio = max(a / b for a, b in zip(memory["terapipe_1f1b"], memory["terapipe_gpipe"]))
    print(f"  1f1b / gpipe (worst stage): {ratio:.2f}")
    print("planner solve times: " + ", ".join(
        f"seq {r['seq']}/g{r['granularity']}: {r['seconds']:.3f} s (target {r['target']:.0f} s)" for r in planner))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="small model, fewer rounds (a smoke run)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds per suite run (default 7; 2 with --quick)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of the whole speed suite; results.json keeps each and the medians")
    p.add_argument("--out", help="the results JSON (default benchmarks/results/cpu/schedules.json; "
                                 "gpu/<card>/ with --device cuda), or a folder for results.json")
    p.add_argument("--chart", help="also draw the speed rows as a PNG here")
    args = p.parse_args(argv)
    args.out = args.out or default_out("schedules.json", args.device, scratch=args.quick)
    args.json, args.folder = output_paths(args.out, "results.json")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: run the suite at least once (--repeats 1)")
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds {args.rounds}: time at least one round (--rounds 1)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    origin = provenance(script_command(__file__, argv))
    print(f"machine: {describe(origin)}; device {args.device}", flush=True)
    os.makedirs(args.folder, exist_ok=True)
    quick = args.quick
    rounds = args.rounds or (2 if quick else 7)

    started = time.perf_counter()
    # Stages run one thread each: profile the layer with one thread too.
    torch.set_num_threads(1)
    runs = [suite_run(args, rounds, quick, i) for i in range(args.repeats)]
    speed_rows = median_rows(runs)
    capacity = statistics.median(run["parallel_capacity"] for run in runs)

    print("memory: 8 microbatches ...", flush=True)
    mem_model = TinyGPT(num_layers=2 * STAGES, hidden_size=256 if quick else 512, num_attention_heads=8,
                        vocab_size=1024, seq_length=512 if quick else 1024)
    mem_plan = TeraPipePlan.uniform(mem_model.seq_length, 8, multiple_of=64)
    memory = memory_table(mem_model, mem_plan, 8)
    print("planner ...", flush=True)
    planner = planner_times(repeats=3)

    results = {"provenance": origin,
               "setup": {"device": args.device, "stages": STAGES, "rounds": rounds,
                         "suite_runs": args.repeats, "quick": quick},
               "machine": {"device": args.device, "parallel_capacity": capacity},
               "speed": speed_rows, "runs": runs, "memory_peak_bytes": memory,
               "memory_setup": {"seq_length": mem_model.seq_length, "slices": list(mem_plan.seq_slices),
                                "num_microbatches": 8, "hidden": mem_model.hidden_size},
               "planner": planner, "wall_seconds": time.perf_counter() - started}
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    try:
        if args.chart:
            chart(results, args.chart)
    except ImportError:
        print("(no matplotlib: skipped the chart; pip install matplotlib)")

    print_speed(speed_rows, args.repeats)
    print_memory_and_planner(memory, mem_model, planner)
    print(f"wrote {args.json} in {results['wall_seconds'] / 60:.1f} min")
    print_headline(speed_rows, args.repeats, capacity)
    return 0


def print_headline(speed_rows: list[dict], suite_runs: int, capacity: float) -> None:
    dp1 = next(r for r in speed_rows if r["config"] == "terapipe_dp" and r["num_microbatches"] == 1)
    runs = (f"; median of {suite_runs} suite runs: "
            + ", ".join(f"{x:.3f}x" for x in dp1["speedup_vs_megatron_per_run"]) if suite_runs > 1 else "")
    print(f"headline: TeraPipe DP vs Megatron 1F1B, 1 microbatch, {dp1['case']}: "
          f"{dp1['speedup_vs_megatron']:.2f}x (pipeline limit here {min(capacity, STAGES):.2f}x{runs})")


if __name__ == "__main__":
    sys.exit(main())
