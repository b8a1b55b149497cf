"""The planner's predictions against measurements on this CPU: peak memory per stage, and the
schedule `--pipeline-schedule auto` picks against the one measured fastest.

    python benchmarks/bench_memory.py               # both parts (CPU, ~15 min on 2 cores)
    python benchmarks/bench_memory.py --part memory # predicted vs measured peaks only
    python benchmarks/bench_memory.py --part auto   # auto's pick vs measured times only

1. memory: a memory profile of the model is measured (megatron/measure/memory.py), then for a
   grid of plans (both orders, 1-16 token slices, batch slices, 1-8 microbatches, both
   weight-gradient modes, Megatron's 1F1B) on 2 and 4 stages the simulator's peak per stage is
   compared with the measured peak of what each stage keeps for backward (saved tensors, K/V
   gradient buffers, deferred pieces; harness/memory_runs.py). Target: within 10% everywhere.
2. auto: on 2 stages, 1 and 4 microbatches, two model sizes, the schedule table
   (planner/schedule_choice.py) is built with a cost model profiled here, and every runnable
   candidate (Megatron's 1F1B, its interleaved 1F1B, TeraPipe's plan per order) is timed in
   interleaved rounds (harness/schedule_runs.py). Target: auto's pick measures within 5% of the
   fastest.
Results go to benchmarks/results/cpu/memory.json and auto.json, each with its provenance first
(benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")  # profiles measured as the stages run: one thread
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__)), os.path.join(ROOT, "tests")]

from harness import TinyGPT, spawn  # noqa: E402
from harness.measured.memory_runs import MemoryRun  # noqa: E402
from megatron_terapipe.plan import TeraPipePlan  # noqa: E402
from provenance import describe, provenance, script_command  # noqa: E402

SEQ = 512


# ---------------------------------------------------------------------------------------------
# 1. Memory
# ---------------------------------------------------------------------------------------------
def memory_model(stages: int) -> TinyGPT:
    return TinyGPT(num_layers=2 * stages, hidden_size=256, num_attention_heads=8,
                   vocab_size=1024, seq_length=SEQ)


def memory_grid() -> list[MemoryRun]:
    runs = [MemoryRun("Megatron 1F1B, M=1", None, 1, 1), MemoryRun("Megatron 1F1B, M=8", None, 8, 1)]
    for order in ("1f1b", "gpipe"):
        for n, M, defer in [(1, 1, False), (4, 4, False), (8, 8, True), (16, 1, True), (16, 4, False)]:
            plan = replace(TeraPipePlan.uniform(SEQ, n, order=order, multiple_of=8), defer_wgrad=defer)
            name = f"{order}, {n} slice{'s' if n > 1 else ''}, M={M}" + (" +W" if defer else "")
            runs.append(MemoryRun(name, plan, M, 1))
        plan = replace(TeraPipePlan.uniform(SEQ, 4, order=order, multiple_of=8, batch_slices=[1, 1]),
                       defer_wgrad=False)
        runs.append(MemoryRun(f"{order}, 4 slices x 2 batch slices, M=2, 2 rows", plan, 2, 2))
    return runs


def fitted_memory(model: TinyGPT, layers_per_stage: int):
    from megatron_terapipe.planner.profile.memory_fit import FittedMemory

    data = spawn(1, "harness.measured.memory_runs:measure_memory_profile", model, 8, timeout=1800)[0]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(data, fh)
    return FittedMemory.load(fh.name, layers_per_stage=layers_per_stage)


def memory_part() -> dict:
    from megatron_terapipe.planner import FunctionCostModel, simulate
    from megatron_terapipe.schedule import build_schedule

    memory = fitted_memory(memory_model(1), 2)
    times = FunctionCostModel(lambda b, l, c: 1e-4 * b * (l + 0.5 * c) + 2e-3)
    rows = []
    for stages in (2, 4):
        runs = memory_grid()
        measured = spawn(stages, "harness.measured.memory_runs:measure_run_peaks", memory_model(stages),
                         runs, timeout=3600)
        for run in runs:
            plan = run.plan or TeraPipePlan([SEQ], order="1f1b", defer_wgrad=False)
            schedule = build_schedule(plan, run.num_microbatches, stages, run.micro_batch_size)
            peaks = simulate(schedule, times, memory=memory, megatron=run.plan is None).peak_memory_bytes
            rows.append({"stages": stages, "case": run.name, "predicted": list(peaks),
                         "measured": [m[run.name] for m in measured]})
        rows += interleaved_rows(stages, memory, times)
    return {"model": vars(memory_model(1)) | {"params_dtype": "float32"}, "rows": rows,
            "fit_error": memory.max_fit_error}


def interleaved_rows(stages: int, memory, times) -> list[dict]:
    """Megatron's interleaved 1F1B, 2 chunks of one layer per stage, 4 and 8 microbatches."""
    from megatron_terapipe.planner import simulate
    from megatron_terapipe.schedule import build_interleaved_schedule

    rows = []
    for M in (4, 8):
        measured = spawn(stages, "harness.measured.memory_runs:measure_interleaved_peak",
                         memory_model(stages), 2, M, timeout=3600)
        schedule = build_interleaved_schedule(SEQ, M, stages, 2, 1)
        peaks = simulate(schedule, times, memory=memory).peak_memory_bytes
        rows.append({"stages": stages, "case": f"Megatron interleaved, 2 chunks, M={M}",
                     "predicted": list(peaks), "measured": measured})
    return rows


def print_memory(result: dict) -> float:
    print(f"\npeak per stage, MiB (predicted / measured, error); hidden 256, seq {SEQ}, "
          "2 layers per stage, float32:")
    worst = 0.0
    for r in result["rows"]:
        cells = []
        for p, m in zip(r["predicted"], r["measured"]):
            worst = max(worst, abs(p / m - 1))
            cells.append(f"{p / 2**20:7.2f} / {m / 2**20:7.2f} ({100 * (p / m - 1):+.1f}%)")
        print(f"  {r['stages']} stages  {r['case']:<42} " + "  ".join(cells))
    print(f"worst error over every stage of every case: {100 * worst:.1f}% (target 10%)")
    return worst


# ---------------------------------------------------------------------------------------------
# 2. auto against measured times
# ---------------------------------------------------------------------------------------------
AUTO_MODELS = {"hidden 256, seq 1024": TinyGPT(num_layers=4, hidden_size=256, num_attention_heads=4,
                                               vocab_size=1024, seq_length=1024),
               "hidden 512, seq 2048": TinyGPT(num_layers=4, hidden_size=512, num_attention_heads=8,
                                               vocab_size=1024, seq_length=2048)}


def auto_case(name: str, model: TinyGPT, num_microbatches: int, repeats: int, cache: str) -> dict:
    from pipeline_plans import profile_cost_model

    from harness.measured.schedule_runs import ScheduleRuns, stage_seconds
    from megatron_terapipe.planner.cost.stage_memory import MemoryBudget
    from megatron_terapipe.planner.schedule_choice import compare_schedules
    from megatron_terapipe.planner.search import SearchSpace

    cost = profile_cost_model(model, 64, model.num_layers // 2, "cpu", cache)
    # the candidate set auto.json was measured on: W actions in their default places
    table = compare_schedules(cost, SearchSpace(model.seq_length, 1, 2, num_microbatches,
                                                granularity=64, batch_sizes="none",
                                                place_wgrad=False),
                              MemoryBudget(None), model.num_layers // 2)
    choice = table.auto()
    schedules = {o.name: (o.plan if o.family == "terapipe" else
                          (None if o.num_chunks == 1 else o.num_chunks))
                 for o in table.options if o.runnable}
    runs = ScheduleRuns(model, num_microbatches, repeats, schedules)
    per_rank = spawn(2, "harness.measured.schedule_runs:time_schedules", runs, timeout=3600)
    measured = {label: statistics.median(stage_seconds(per_rank, label)) for label in schedules}
    fastest = min(measured, key=measured.get)
    return {"case": name, "num_microbatches": num_microbatches, "auto": choice.chosen.name,
            "runner_up": choice.runner_up.name if choice.runner_up else None,
            "predicted_margin": choice.margin, "fastest_measured": fastest,
            "auto_over_fastest": measured[choice.chosen.name] / measured[fastest],
            "rows": [{"schedule": o.name, "predicted_s": o.time, "note": o.note,
                      "measured_s": measured.get(o.name)} for o in table.options]}


def auto_part(repeats: int, out_dir: str) -> list[dict]:
    results = []
    for name, model in AUTO_MODELS.items():
        cache = os.path.join(out_dir, f"profile_cpu_h{model.hidden_size}_s{model.seq_length}.json")
        for M in (1, 4):
            print(f"auto: {name}, {M} microbatch(es) ...", flush=True)
            results.append(auto_case(name, model, M, repeats, cache))
    return results


def print_auto(results: list[dict]) -> float:
    worst = 1.0
    for r in results:
        print(f"\n{r['case']}, {r['num_microbatches']} microbatch(es), 2 stages:")
        for row in r["rows"]:
            measured = "-" if row["measured_s"] is None else f"{row['measured_s']:.3f} s"
            predicted = "-" if row["predicted_s"] is None else f"{row['predicted_s']:.3f} s"
            mark = (" <- auto" if row["schedule"] == r["auto"] else "") + (
                " <- fastest measured" if row["schedule"] == r["fastest_measured"] else "")
            print(f"  {row['schedule']:<32} predicted {predicted:>9}  measured {measured:>9}  "
                  f"{row['note']}{mark}")
        print(f"  auto's pick measured {100 * (r['auto_over_fastest'] - 1):+.1f}% against the fastest")
        worst = max(worst, r["auto_over_fastest"])
    print(f"\nworst: auto's pick within {100 * (worst - 1):.1f}% of the fastest measured (target 5%)")
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("memory", "auto", "both"), default="both")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds of timed runs")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu"),
                   help="folder for memory.json and auto.json (and the cached layer profiles)")
    args = p.parse_args(argv)
    import torch

    command = script_command(__file__, argv)
    torch.set_num_threads(1)  # the layer profile is measured here, as one stage process runs it
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    if args.part in ("memory", "both"):
        origin = provenance(command)
        print(f"machine: {describe(origin)}", flush=True)
        result = memory_part()
        result["worst_error"] = print_memory(result)
        with open(os.path.join(args.out, "memory.json"), "w") as fh:
            json.dump({"provenance": origin, **result}, fh, indent=1, default=str)
    if args.part in ("auto", "both"):
        origin = provenance(command)  # its own start: the memory part may have run first
        print(f"machine: {describe(origin)}", flush=True)
        results = auto_part(args.repeats, args.out)
        worst = print_auto(results)
        with open(os.path.join(args.out, "auto.json"), "w") as fh:
            json.dump({"provenance": origin, "cases": results, "worst_auto_over_fastest": worst},
                      fh, indent=1)
    print(f"wrote results to {args.out} in {(time.perf_counter() - started) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
