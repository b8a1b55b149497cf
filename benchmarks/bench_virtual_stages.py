"""TeraPipe on virtual stages with planned W places against Megatron's schedules, simulated.

    python benchmarks/bench_virtual_stages.py [--microbatches 1,8,32] [--sequence-parallel]
        [--recompute-method uniform|block [--recompute-num-layers N]]
        [--out benchmarks/results/planner/virtual_stages.json]

gpt3-13b on the H100 preset, 8 pipeline stages x TP 8 (inter-node pipeline links), sequences
of 8192 tokens, micro batch 1. For each microbatch count the memory budget is 20 GiB per GPU
or Megatron 1F1B's own predicted peak, whichever is larger. terapipe-plan's schedule table is
made three ways under the same analytic cost model: as it stands (every chunk count that
divides a stage's 5 layers, W placement on), as before virtual stages and W placement
(--virtual-stages 1 --wgrad-placement off: "before"), and with no budget (what the fastest
layouts would need). Each row: predicted iteration, speed-up over Megatron's 1F1B, bubble,
peak per stage (activations, K/V and model state), whether it fits, and the plan (slices,
chunks, group, warm-up, W places). The bubble-free limit is Megatron 1F1B's time over its
busiest stage's compute; "recompute_one_layer" is the same limit once at least one layer per
stage is recomputed for every microbatch (recompute_ceiling). Everything is simulated: no GPU is involved. The JSON starts with
its provenance (benchmarks/provenance.py). --sequence-parallel asks every table with
terapipe-plan's --sequence-parallel (Megatron's: both sides' activations and messages split over
the TP ranks) and writes virtual_stages_sequence_parallel.json by default. --scatter-gather-p2p
asks them with terapipe-plan's --scatter-gather-p2p (TeraPipe's messages in TP parts, gathered
inside the node; Megatron's rows keep whole messages, as megatron-core sends them) and writes
virtual_stages_scatter_gather.json; each case then also gives Megatron 1F1B as if it sent in
parts too ("megatron_1f1b_in_parts_ms"), the stricter baseline, and what TeraPipe would reach
if the gather overlapped the stage's compute ("if_gather_overlapped": the gather priced as link
time, not the stage's; the runtime gathers where the cell takes its input, so this is a
what-if, not a prediction of the runtime as it is). --recompute-method (and
--recompute-num-layers) asks them with Megatron's full recomputation on both sides (its rerun
forwards and what its checkpointed groups keep) and writes virtual_stages_recompute_<method><N>.json;
each case then also gives Megatron 1F1B without recomputation ("megatron_1f1b_plain_ms") and
the chosen plan's speed-up over it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_terapipe.planner.cli.command import build_parser  # noqa: E402
from megatron_terapipe.planner.cli.arguments import inputs_from_options  # noqa: E402
from megatron_terapipe.planner.cost.stage_memory import GiB  # noqa: E402
from megatron_terapipe.planner.evaluate.simulator import simulate  # noqa: E402
from megatron_terapipe.planner.schedule_choice import ScheduleOption, ScheduleTable  # noqa: E402
from megatron_terapipe.plan import TeraPipePlan  # noqa: E402
from megatron_terapipe.schedule import build_schedule  # noqa: E402
from provenance import provenance, script_command  # noqa: E402

MODEL = ("--model gpt3-13b --hardware h100 --pipeline-stages 8 --tensor-parallel-size 8 "
         "--seq-length 8192 --micro-batch-size 1").split()
TARGETS = {1: 3.12, 8: 1.55, 32: 1.15}  # speed-up over Megatron 1F1B to reach
BEFORE = ["--virtual-stages", "1", "--wgrad-placement", "off"]
RUN_OPTIONS: list[str] = []  # ["--sequence-parallel"] under --sequence-parallel; RECOMPUTE last
RECOMPUTE: list[str] = []  # ["--recompute-method", "uniform", ...] under --recompute-method


def table(microbatches: int, extra: list[str],
          gather_overlapped: bool = False) -> tuple[ScheduleTable, float]:
    """terapipe-plan's schedule table for `microbatches` with options `extra`, and seconds;
    `gather_overlapped`: the what-if of overlapped_gather."""
    parser = build_parser()
    args = parser.parse_args(MODEL + RUN_OPTIONS + ["--num-microbatches", str(microbatches), *extra])
    start = time.perf_counter()
    inputs = inputs_from_options(args, parser)
    if gather_overlapped:
        inputs.cost_model = overlapped_gather(inputs.cost_model)
    out = inputs.schedule_table()
    return out, time.perf_counter() - start


def overlapped_gather(parts):
    """The scatter-gather cost model `parts` with the receivers' gather counted as link time
    (as if it ran while the stage computes) instead of the stage's own; Megatron's rows keep
    whole messages."""
    out = copy.copy(parts)
    out.transfer_time = lambda b, l: parts.transfer_time(b, l) + parts.receive_time(b, l)
    out.receive_time = lambda b, l: 0.0 * parts.receive_time(b, l)
    out.without_scatter_gather = parts.without_scatter_gather
    return out


def row(option: ScheduleOption, base: float) -> dict:
    out = {"name": option.name, "note": option.note, "fits": option.fits}
    if option.runnable:
        r = option.result
        out.update(iteration_ms=round(r.iteration_time * 1e3, 3),
                   speedup=round(base / r.iteration_time, 4),
                   bubble=round(r.bubble_fraction, 4),
                   peak_gib=[round(t / GiB, 3) for t in option.totals],
                   busy_ms=[round(b * 1e3, 3) for b in r.busy])
    if option.plan is not None:
        out["plan"] = option.plan.to_dict()
        out["plan"].pop("wgrad_after", None)  # long: its presence is in "W placed"
        out["w_placed"] = bool(option.plan.wgrad_after)
    return out


def best(rows: list[dict], family_prefix: str) -> dict:
    return min((r for r in rows if r["fits"] and r["name"].startswith(family_prefix)
                and "iteration_ms" in r), key=lambda r: r["iteration_ms"], default={})


def recompute_ceiling(microbatches: int, base: float, busiest: float) -> dict:
    """The most any plan can gain over Megatron 1F1B (`base` seconds) once it recomputes at
    least one whole layer per stage for every microbatch (Megatron's --recompute-granularity
    full --recompute-num-layers 1, the least it recomputes; per chunk on virtual stages, so
    more there): the busiest stage's compute (`busiest`) plus one layer's forward per
    microbatch, with no bubble at all."""
    parser = build_parser()
    args = parser.parse_args(MODEL + RUN_OPTIONS + ["--num-microbatches", str(microbatches)])
    inputs = inputs_from_options(args, parser)
    layer_forward = float(inputs.cost_model.forward_time(args.micro_batch_size, args.seq_length,
                                                         0)) / inputs.layers_per_stage
    return {"layer_forward_ms": round(layer_forward * 1e3, 3),
            "speedup_ceiling": round(base / (busiest + microbatches * layer_forward), 4)}


def megatron_1f1b_in_parts(microbatches: int) -> dict:
    """Megatron 1F1B simulated on the scatter-gather cost model (its whole sequences, its
    order, but messages in TP parts as TeraPipe's): what TeraPipe's rows would be compared
    with if Megatron sent in parts too."""
    parser = build_parser()
    args = parser.parse_args(MODEL + RUN_OPTIONS + ["--num-microbatches", str(microbatches)])
    inputs = inputs_from_options(args, parser)
    whole = TeraPipePlan([args.seq_length], order="1f1b", defer_wgrad=False)
    schedule = build_schedule(whole, microbatches, args.pipeline_stages, args.micro_batch_size)
    result = simulate(schedule, inputs.cost_model, memory=inputs.space.memory, megatron=True)
    return {"iteration_ms": round(result.iteration_time * 1e3, 3)}


def megatron_1f1b_plain(microbatches: int) -> float:
    """Megatron 1F1B's predicted seconds without recomputation (RUN_OPTIONS less it)."""
    parser = build_parser()
    options = RUN_OPTIONS[:len(RUN_OPTIONS) - len(RECOMPUTE)]
    args = parser.parse_args(MODEL + options + ["--num-microbatches", str(microbatches)])
    inputs = inputs_from_options(args, parser)
    whole = TeraPipePlan([args.seq_length], order="1f1b", defer_wgrad=False)
    schedule = build_schedule(whole, microbatches, args.pipeline_stages, args.micro_batch_size)
    return simulate(schedule, inputs.cost_model.without_scatter_gather(), megatron=True).iteration_time


def case(microbatches: int) -> dict:
    free, _ = table(microbatches, [])
    megatron = next(o for o in free.options if o.name == "Megatron 1F1B")
    base = megatron.time
    budget = max(20 * GiB, max(megatron.totals))
    limited, seconds = table(microbatches, ["--memory-budget", str(budget)])
    before, _ = table(microbatches, ["--memory-budget", str(budget), *BEFORE])
    rows = [row(o, base) for o in limited.options]
    chosen = best(rows, "TeraPipe")
    interleaved = best(rows, "Megatron interleaved")
    # the targets are for the question without recomputation
    target = None if RECOMPUTE else TARGETS.get(microbatches)
    extra = {}  # the scatter-gather or recomputation runs' own fields
    if "--scatter-gather-p2p" in RUN_OPTIONS:
        parts_ms = megatron_1f1b_in_parts(microbatches)["iteration_ms"]
        overlapped, _ = table(microbatches, ["--memory-budget", str(budget)], True)
        what_if = best([row(o, base) for o in overlapped.options], "TeraPipe")
        extra = {"megatron_1f1b_in_parts_ms": parts_ms,
                 "speedup_vs_megatron_1f1b_in_parts": (
                     round(parts_ms / chosen["iteration_ms"], 4) if chosen else None),
                 "if_gather_overlapped": what_if}
    if RECOMPUTE:
        plain = megatron_1f1b_plain(microbatches)
        extra.update(megatron_1f1b_plain_ms=round(plain * 1e3, 3),
                     speedup_vs_megatron_1f1b_plain=(
                         round(plain * 1e3 / chosen["iteration_ms"], 4) if chosen else None))
    return {
        "microbatches": microbatches,
        "budget_gib": round(budget / GiB, 3),
        "megatron_1f1b_ms": round(base * 1e3, 3),
        "bubble_free_limit": round(base / max(megatron.result.busy), 4),
        "recompute_one_layer": recompute_ceiling(microbatches, base, max(megatron.result.busy)),
        "planning_seconds": round(seconds, 2),
        "best_terapipe": chosen,
        "target_speedup": target,
        "target_met": bool(target and chosen and chosen["speedup"] >= target),
        "not_below_megatron_interleaved": (not interleaved
                                           or chosen["iteration_ms"] <= interleaved["iteration_ms"]),
        **extra,
        "rows": rows,
        "before": [row(o, base) for o in before.options if o.family == "terapipe"],
        "no_budget": [row(o, base) for o in free.options if o.family == "terapipe"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", default="1,8,32", help="comma list (default 1,8,32)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's --sequence-parallel on both sides")
    p.add_argument("--scatter-gather-p2p", action="store_true",
                   help="TeraPipe's messages in TP parts (terapipe-plan's --scatter-gather-p2p)")
    p.add_argument("--out", help="results file (default: benchmarks/results/planner/"
                                 "virtual_stages.json, "
                                 "virtual_stages_sequence_parallel.json or "
                                 "virtual_stages_scatter_gather.json)")
    p.add_argument("--recompute-method", choices=("uniform", "block"),
                   help="Megatron's full recomputation on both sides")
    p.add_argument("--recompute-num-layers", type=int, default=1,
                   help="with --recompute-method (default 1)")
    args = p.parse_args(argv)
    if args.sequence_parallel and args.scatter_gather_p2p:
        p.error("--scatter-gather-p2p and --sequence-parallel: give one (sequence parallelism "
                "splits the messages already)")
    name = ("virtual_stages_sequence_parallel" if args.sequence_parallel else
            "virtual_stages_scatter_gather" if args.scatter_gather_p2p else "virtual_stages")
    RECOMPUTE[:] = ([] if args.recompute_method is None else
                    ["--recompute-method", args.recompute_method,
                     "--recompute-num-layers", str(args.recompute_num_layers)])
    recompute = RECOMPUTE
    if recompute:
        name = f"virtual_stages_recompute_{args.recompute_method}{args.recompute_num_layers}"
    args.out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        "planner", f"{name}.json")
    RUN_OPTIONS[:] = (["--sequence-parallel"] if args.sequence_parallel else
                      ["--scatter-gather-p2p"] if args.scatter_gather_p2p else []) + recompute
    origin = provenance(script_command(__file__, argv))
    cases = [case(int(m)) for m in args.microbatches.split(",")]
    for c in cases:
        b = c["best_terapipe"]
        print(f"{c['microbatches']:>3} microbatches, budget {c['budget_gib']:.2f} GiB: "
              f"{b.get('name')} {b.get('iteration_ms')} ms, {b.get('speedup')}x over Megatron "
              f"1F1B ({c['megatron_1f1b_ms']} ms; bubble-free limit {c['bubble_free_limit']}x"
              + (f"; target {c['target_speedup']}x {'met' if c['target_met'] else 'NOT met'}"
                 if c['target_speedup'] else "") + f"); planned in {c['planning_seconds']} s")
        if "megatron_1f1b_in_parts_ms" in c:
            w = c["if_gather_overlapped"]
            print(f"    over Megatron 1F1B sending in parts too ({c['megatron_1f1b_in_parts_ms']} ms): "
                  f"{c['speedup_vs_megatron_1f1b_in_parts']}x; if the gather overlapped the "
                  f"stage's compute: {w.get('iteration_ms')} ms, {w.get('speedup')}x")
        if "megatron_1f1b_plain_ms" in c:
            print(f"    over Megatron 1F1B without recomputation ({c['megatron_1f1b_plain_ms']} "
                  f"ms): {c['speedup_vs_megatron_1f1b_plain']}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"provenance": origin, "sequence_parallel": args.sequence_parallel,
                   "scatter_gather_p2p": args.scatter_gather_p2p,
                   "recompute": " ".join(recompute) or None, "cases": cases}, f, indent=1)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
