"""`--pipeline-schedule auto` that measures, in Megatron-LM's own pretrain_gpt.py on CPU: does
the schedule it keeps match the fastest candidate timed alone, is it never slower than
Megatron's, and does it train as a plain 1f1b run?

For each microbatch count and cost model (the default; deliberately wrong ones: the analytic
H100 on this CPU, and this model's measured layer profile scaled 3x), one auto run through the
launcher (`--terapipe-cpu --pipeline-schedule auto`, 2 stages) logs its shortlist, each trial
and the kept schedule (and each candidate's plan). Then every candidate of every auto run of
that microbatch count is timed alone (benchmarks/auto_alone.py: the shortlist replaced by that
one candidate, its median over --trials iterations after one warm-up), in --rounds interleaved
rounds. A candidate's alone time is the median of its rounds; its paired time is the median of
its ratios to Megatron's schedule (1F1B, or interleaved on chunks) in the same round, times
Megatron's median, which cancels load that drifts between rounds. The targets are judged on
the paired times. A plain run of Megatron's schedule gives the losses and grad norms the auto
run must log (rel 1e-5). On chunks with fewer microbatches than stages Megatron's interleaved
schedule does not run (it needs one microbatch per stage), so auto has no Megatron candidate:
the pairs are then to the first candidate, and the plain run is `--pipeline-schedule terapipe`
with one slice on the same chunks, whose gradients equal Megatron's wherever both run (tests). Per auto run: the kept schedule's time over the fastest of that run's
own candidates, over the fastest of all candidates, and over Megatron's schedule. Per
candidate, the spread of its rounds (quartile_spread, of the times and of the paired ratios):
on a shared machine it can be as large as the margins the targets ask about.

    python benchmarks/bench_auto.py --checkout MEGATRON_LM [--layers 2] [--rounds 7]

Writes benchmarks/results/megatron_lm/auto.json (--out), provenance first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))  # this checkout's package, as the runs it launches import
from provenance import provenance, script_command  # noqa: E402

TRIAL = re.compile(r"^terapipe auto: trial (.+): ([0-9.]+) ms measured, (.+) predicted$", re.M)
KEEP = re.compile(r"^terapipe auto: keeping (.+) \(", re.M)
SHORTLIST = re.compile(r"^> terapipe auto: timing \d+ schedules on .*?: (.+)$", re.M)
ITERATION = re.compile(r"iteration\s+(\d+)/.*lm loss: ([0-9.E+-]+).*grad norm: ([0-9.]+)")


def model_flags(args, microbatches: int) -> list[str]:
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--num-layers", str(args.layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "8", "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length), "--micro-batch-size", "1",
            "--global-batch-size", str(microbatches), "--lr", "1e-3", "--log-interval", "1",
            "--eval-iters", "0", "--eval-interval", "100000", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--pipeline-model-parallel-size", "2", "--terapipe-cpu",
            *(["--num-virtual-stages-per-pipeline-rank", str(args.chunks)]
              if args.chunks > 1 else [])]


def launch(args, entry: list[str], flags: list[str], iterations: int) -> str:
    """One run on 2 CPU processes; its log (raises with its tail on failure)."""
    from harness.megatron_lm import checkout_env
    from harness.spawn import free_port

    script = os.path.join(args.checkout, "pretrain_gpt.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), *entry, script, *flags,
           "--train-iters", str(iterations)]
    out = subprocess.run(cmd, cwd=args.checkout, env=checkout_env(args.checkout),
                         capture_output=True, text=True, timeout=3600)
    log = out.stdout + out.stderr
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{log[-3000:]}")
    return log


def layer_profile(args, microbatches: int, cache: str) -> str:
    """This model's measured layer profile scaled 3x (the third cost model)."""
    from megatron_terapipe.planner.profile.time_fit import LayerTimeFit

    launch(args, ["-m", "megatron_terapipe.megatron.launch"],
           [*model_flags(args, microbatches), "--pipeline-schedule", "terapipe",
            "--terapipe-cost-model", "profile", "--terapipe-cache-dir", cache], 1)
    path = next(Path(cache).glob("layer-profile-*.json"))
    data = json.loads(path.read_text())
    for key in ("forward", "backward", "deferred_backward", "wgrad"):
        data["measurements"][key] = [None if v is None else 3 * v
                                     for v in data["measurements"][key]]
    scaled = Path(cache) / "layer-profile-scaled-3x.json"
    from megatron_terapipe.planner.profile.least_squares import fit_layer_times

    fit = LayerTimeFit.from_dict(data)
    refit = fit_layer_times(fit.measurements)
    refit.edges, refit.metadata = fit.edges, fit.metadata  # the embedding and loss as measured
    refit.save(scaled)
    return str(scaled)


def auto_run(args, microbatches: int, cost: list[str], cache: str) -> dict:
    iterations = args.iterations
    log = launch(args, ["-m", "megatron_terapipe.megatron.launch"],
                 [*model_flags(args, microbatches), "--pipeline-schedule", "auto",
                  "--terapipe-auto-trials", str(args.trials), "--terapipe-cache-dir", cache,
                  *cost], iterations)
    kept = KEEP.findall(log)
    return {"cost_model": " ".join(cost) or "default", "shortlist": SHORTLIST.findall(log)[0]
            .split("; "), "trials": [(n, float(ms), p) for n, ms, p in TRIAL.findall(log)],
            "kept": kept[-1] if kept else None, "plans": plans_of(log),
            "iterations": [(int(i), float(l), float(n)) for i, l, n in ITERATION.findall(log)]}


PLAN = re.compile(r'^terapipe auto plan: (.+?) = (\{.+\}|"megatron")$', re.M)


def plans_of(log: str) -> dict[str, str]:
    """The candidates' plans as the run printed them (auto_trials.plan_lines)."""
    def normal(text: str) -> str:  # one key per plan, whatever each run predicted of it
        if text == '"megatron"':
            return "megatron"
        return json.dumps({k: v for k, v in json.loads(text).items() if k != "predicted_time"},
                          sort_keys=True)

    return {name: normal(text) for name, text in PLAN.findall(log)}


def alone(args, microbatches: int, name: str, plan: str, cost: list[str], cache: str) -> float:
    log = launch(args, [str(HERE / "auto_alone.py"), name, plan],
                 [*model_flags(args, microbatches), "--pipeline-schedule", "auto",
                  "--terapipe-auto-trials", str(args.trials), "--terapipe-cache-dir", cache,
                  *cost], args.trials + 1)
    found = [float(ms) for n, ms, _ in TRIAL.findall(log) if n == name]
    return found[-1] / 1e3


def bench_case(args, microbatches: int) -> dict:
    cache = tempfile.mkdtemp(prefix="bench-auto-")
    costs = [[], ["--terapipe-hardware", "h100"]]
    if args.profile:
        costs.append(["--terapipe-cost-model", layer_profile(args, microbatches, cache)])
    runs = []
    for cost in costs:
        run_cache = tempfile.mkdtemp(prefix="bench-auto-run-")  # no calibration carried over
        runs.append(auto_run(args, microbatches, cost, run_cache))
        print(f"{microbatches} microbatches, {runs[-1]['cost_model']}: kept {runs[-1]['kept']}",
              flush=True)
    candidates = {}  # plan JSON -> name (the first run's)
    for run in runs:
        for name, plan in run["plans"].items():
            candidates.setdefault(plan, name)
    times: dict[str, list[float]] = {plan: [] for plan in candidates}
    for r in range(args.rounds):
        for plan, name in candidates.items():
            times[plan].append(alone(args, microbatches, name, plan, [], cache))
        print(f"{microbatches} microbatches: alone round {r + 1} of {args.rounds}", flush=True)
    reference = launch(args, ["-m", "megatron_terapipe.megatron.launch"],
                       [*model_flags(args, microbatches), *plain_schedule(args, microbatches)],
                       args.iterations)
    plain = [(int(i), float(l), float(n)) for i, l, n in ITERATION.findall(reference)]
    return summarise(microbatches, runs, candidates, times, plain)


def plain_schedule(args, microbatches: int) -> list[str]:
    """The schedule of the plain run whose losses auto must log: Megatron's, unless on chunks
    with fewer microbatches than stages, where Megatron's interleaved schedule refuses to run."""
    if args.chunks > 1 and microbatches < 2:  # 2 pipeline stages
        return ["--pipeline-schedule", "terapipe", "--terapipe-num-slices", "1"]
    return ["--pipeline-schedule", "1f1b"]


def paired_medians(times: dict[str, list[float]]) -> dict[str, float]:
    """Each plan's median over the rounds of its time over Megatron's schedule in the same round
    (or the first candidate's, where Megatron's does not run), times that one's median: load
    that drifts between rounds (this machine is shared) cancels, as interleaving intends."""
    scale = statistics.median(times[reference_plan(times)])
    return {plan: statistics.median(r) * scale for plan, r in round_ratios(times).items()}


def reference_plan(times: dict[str, list[float]]) -> str:
    """The plan the pairs are to: Megatron's schedule, or the first candidate without it."""
    return "megatron" if "megatron" in times else next(iter(times))


def quartile_spread(values) -> float:
    """(upper quartile - lower quartile) / median: how far apart rounds of one candidate fall,
    the size of difference between candidates that the rounds can resolve."""
    low, mid, high = statistics.quantiles(values, n=4)
    return (high - low) / mid


def round_ratios(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each plan's time over the reference's (paired_medians's) in the same round."""
    reference = times[reference_plan(times)]
    return {plan: [t / m for t, m in zip(ts, reference)] for plan, ts in times.items()}


def ratios(kept_s, own: dict, fastest: float, megatron) -> dict:
    if not kept_s:
        return {"kept_over_fastest_own": None, "kept_over_fastest": None,
                "kept_over_megatron": None}
    return {"kept_over_fastest_own": kept_s / min(own.values()),
            "kept_over_fastest": kept_s / fastest,
            "kept_over_megatron": kept_s / megatron if megatron else None}


def summarise(microbatches, runs, candidates, times, plain) -> dict:
    alone_s = {plan: statistics.median(t) for plan, t in times.items()}
    paired_s, paired = paired_medians(times), round_ratios(times)
    rows = []
    for run in runs:
        kept_plan = run["plans"].get(run["kept"])
        row = {k: run[k] for k in ("cost_model", "shortlist", "trials", "kept")}
        for label, table in (("alone", alone_s), ("paired", paired_s)):
            own = {name: table[plan] for name, plan in run["plans"].items()}
            row[f"own_candidates_{label}_s"] = own
            row[f"kept_{label}_s"] = table.get(kept_plan)
            row.update({f"{k}_{label}": v for k, v in ratios(
                table.get(kept_plan), own, min(table.values()), table.get("megatron")).items()})
        row["iterations"] = run["iterations"]  # (iteration, lm loss, grad norm) as logged
        row["iterations_compared"] = min(len(run["iterations"]), len(plain))
        row["worst_loss_or_norm_rel_to_1f1b"] = max(
            (max(abs(a[1] - b[1]) / abs(b[1]), abs(a[2] - b[2]) / abs(b[2]))
             for a, b in zip(run["iterations"], plain)), default=None)
        rows.append(row)
    return {"microbatches": microbatches, "runs": rows, "plain_iterations": plain,
            "alone": [{"name": candidates[p], "plan": p, "rounds_s": times[p],
                       "median_s": alone_s[p], "paired_median_s": paired_s[p],
                       "spread": quartile_spread(times[p]),
                       "paired_spread": quartile_spread(paired[p])} for p in candidates]}


def spread_summary(alone: list[dict]) -> dict:
    """The median spread over the candidates; paired, without the reference (its ratios are 1)."""
    reference = reference_plan({a["plan"]: a["rounds_s"] for a in alone})
    return {"median": statistics.median(a["spread"] for a in alone),
            "paired_median": statistics.median(
                a["paired_spread"] for a in alone if a["plan"] != reference)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, help="Megatron-LM checkout")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=1, help="virtual stages the flags fix")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=36,
                        help="each auto run's: enough for the rounds, a re-plan and a runoff")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="leave out the scaled layer profile (saves its measuring run)")
    parser.add_argument("--out", default=str(HERE / "results/megatron_lm/auto.json"))
    args = parser.parse_args(argv)
    origin = provenance(script_command(__file__, argv))
    start = time.perf_counter()
    cases = [bench_case(args, m) for m in args.microbatches]
    result = {"provenance": origin, "seq_length": args.seq_length,
              "hidden_size": args.hidden_size, "layers": args.layers, "chunks": args.chunks,
              "rounds": args.rounds, "trials": args.trials, "iterations": args.iterations,
              "seconds": round(time.perf_counter() - start, 1), "cases": cases}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps([{"microbatches": c["microbatches"], "runs": [
        {k: r[k] for k in ("cost_model", "kept", "kept_over_fastest_own_paired",
                           "kept_over_fastest_paired", "kept_over_megatron_paired",
                           "kept_over_fastest_own_alone", "worst_loss_or_norm_rel_to_1f1b")}
        for r in c["runs"]], "alone_spread": spread_summary(c["alone"])} for c in cases],
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
