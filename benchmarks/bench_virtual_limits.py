"""Why the 32-microbatch question stops short of its target: what each slice count can reach
at best, and what memory the 1-slice interleaved order needs to cover its ring, simulated.

    python benchmarks/bench_virtual_limits.py [--microbatches 32]
        [--out benchmarks/results/planner/virtual_limits.json]

The question of bench_virtual_stages.py (gpt3-13b, H100 preset, 8 stages x TP 8, seq 8192,
micro batch 1; budget: 20 GiB or Megatron 1F1B's own peak, whichever is larger), on 5 model
chunks per stage (5 layers per stage: 1 or 5 are the only chunk counts), deferred W:
1. per slice count (uniform), the compute of the busiest stage: no schedule of those cells
   beats Megatron 1F1B's time over it (the slice count's ceiling), however W is placed;
2. for 1 slice, each group and warm-up (virtual_group, virtual_warmup): the predicted speed-up
   and the peak per GPU against the budget, then with W places (within the budget where the
   plan fits it, else with no budget);
3. the same for 2 chunks in a V (virtual_placement "v", Zero Bubble's ZB-V placement: rank k
   holds virtual stages k and 15 - k, the loss on rank 0; chunks of 2 + 3 or 3 + 2 layers),
   1 or 2 slices, each `virtual_warmup` (units in flight on rank 0 beyond 1F1B's), and its
   busiest stage's ceiling.
Everything is simulated under the analytic cost model: no GPU is involved. The JSON starts
with its provenance (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_virtual_stages import MODEL  # noqa: E402
from megatron_terapipe.plan import TeraPipePlan  # noqa: E402
from megatron_terapipe.planner.cli.command import build_parser  # noqa: E402
from megatron_terapipe.planner.cli.arguments import inputs_from_options  # noqa: E402
from megatron_terapipe.planner.cost.stage_memory import GiB  # noqa: E402
from megatron_terapipe.planner.evaluate.list_estimate import estimate_lists, shared_caches  # noqa: E402
from megatron_terapipe.planner.evaluate.simulator import plan_time, simulate  # noqa: E402
from megatron_terapipe.planner.wgrad_slots import plan_wgrad  # noqa: E402
from megatron_terapipe.schedule import build_schedule  # noqa: E402
from provenance import provenance, script_command  # noqa: E402

CHUNKS = 5
GROUPS = (8, 11, 12, 16, 32)  # the allowed groups of 32 microbatches of one cell
WARMUPS = (None, 3, 1, 0)
V_LEADS = (0, 1, 2, 4, 8)


def inputs(microbatches: int, budget_bytes=None):
    parser = build_parser()
    extra = [] if budget_bytes is None else ["--memory-budget", str(budget_bytes)]
    return inputs_from_options(parser.parse_args(
        MODEL + ["--num-microbatches", str(microbatches), *extra]), parser)


def question(microbatches: int):
    """(inputs without a budget, inputs within it, Megatron 1F1B's seconds, the budget): the
    budget is 20 GiB or Megatron 1F1B's own predicted peak, whichever is larger."""
    free = inputs(microbatches)
    megatron = next(o for o in free.schedule_table().options if o.name == "Megatron 1F1B")
    budget = max(20 * GiB, max(megatron.totals))
    return free, inputs(microbatches, budget), megatron.time, budget


def plan_of(slices: int, **fields) -> TeraPipePlan:
    return replace(TeraPipePlan.uniform(8192, slices, "1f1b", 8), virtual_stages=CHUNKS,
                   defer_wgrad=True, **fields)


def ceilings(run, base: float, microbatches: int) -> list[dict]:
    """Per slice count: the busiest stage's compute and Megatron 1F1B's time over it."""
    out = []
    for n in (1, 2, 3, 4):
        plan = plan_of(n, virtual_group=None)
        busy = max(simulate(build_schedule(plan, microbatches, 8, 1), run.cost_model).busy)
        out.append({"slices": n, "busiest_stage_ms": round(busy * 1e3, 2),
                    "ceiling_speedup": round(base / busy, 4)})
    return out


def one_slice_rows(run, free, base: float, microbatches: int) -> list[dict]:
    caches = shared_caches(run.cost_model, run.space.memory)
    shape = (microbatches, 8, 1)
    rows = []
    for group in GROUPS:
        for warmup in WARMUPS:
            plan = plan_of(1, virtual_group=group, virtual_warmup=warmup)
            found = estimate_lists(build_schedule(plan, *shape), run.cost_model,
                                   run.space.memory, caches)
            seconds = plan_time(plan, run.cost_model, *shape, cache=caches.costs)
            fits = run.budget.fits(found.peak_memory_bytes)
            row = {"group": group, "warmup": warmup, "speedup": round(base / seconds, 4),
                   "peak_gib": round(max(run.budget.totals(found.peak_memory_bytes)) / GiB, 2),
                   "fits": fits}
            _, placed = plan_wgrad(plan, run.cost_model, *shape,
                                   run.budget if fits else free.budget, run.space.memory,
                                   cache=caches.costs, default_time=seconds)
            row["speedup_w_placed"] = round(base / placed, 4)
            rows.append(row)
    return rows


def v_rows(run, free, base: float, microbatches: int) -> list[dict]:
    """The V's rows (module docstring, 3.)."""
    caches = shared_caches(run.cost_model, run.space.memory)
    shape = (microbatches, 8, 1)
    rows = []
    for layers in ((2, 3), (3, 2)):
        for slices in (1, 2):
            for lead in V_LEADS:
                plan = replace(plan_of(slices), virtual_stages=2, virtual_placement="v",
                               chunk_layers=layers, virtual_warmup=lead)
                schedule = build_schedule(plan, *shape)
                found = estimate_lists(schedule, run.cost_model, run.space.memory, caches)
                seconds = plan_time(plan, run.cost_model, *shape, cache=caches.costs)
                fits = run.budget.fits(found.peak_memory_bytes)
                _, placed = plan_wgrad(plan, run.cost_model, *shape,
                                       run.budget if fits else free.budget, run.space.memory,
                                       cache=caches.costs, default_time=seconds)
                busy = max(simulate(schedule, run.cost_model).busy)
                rows.append({"chunk_layers": list(layers), "slices": slices, "warmup": lead,
                             "speedup": round(base / seconds, 4),
                             "peak_gib": round(max(run.budget.totals(found.peak_memory_bytes)) / GiB, 2),
                             "fits": fits, "speedup_w_placed": round(base / placed, 4),
                             "busiest_stage_ms": round(busy * 1e3, 2),
                             "ceiling_speedup": round(base / busy, 4)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "planner", "virtual_limits.json"))
    args = p.parse_args(argv)
    origin = provenance(script_command(__file__, argv))
    free, run, base, budget = question(args.microbatches)
    result = {"microbatches": args.microbatches, "budget_gib": round(budget / GiB, 3),
              "megatron_1f1b_ms": round(base * 1e3, 3),
              "ceilings": ceilings(run, base, args.microbatches),
              "one_slice": one_slice_rows(run, free, base, args.microbatches),
              "v_shape": v_rows(run, free, base, args.microbatches)}
    for c in result["ceilings"]:
        print(f"{c['slices']} slice(s): busiest stage {c['busiest_stage_ms']} ms, at best "
              f"{c['ceiling_speedup']}x over Megatron 1F1B ({result['megatron_1f1b_ms']} ms)")
    for r in result["one_slice"]:
        print(f"1 slice, groups of {r['group']}, warm-up {r['warmup']}: {r['speedup']}x, peak "
              f"{r['peak_gib']} GiB ({'fits' if r['fits'] else 'over'} {result['budget_gib']}),"
              f" W placed {r['speedup_w_placed']}x{'' if r['fits'] else ' (no budget)'}")
    for r in result["v_shape"]:
        print(f"V of {'+'.join(map(str, r['chunk_layers']))} layers, {r['slices']} slice(s), "
              f"warm-up {r['warmup']}: {r['speedup']}x, peak {r['peak_gib']} GiB "
              f"({'fits' if r['fits'] else 'over'}), W placed {r['speedup_w_placed']}x"
              f"{'' if r['fits'] else ' (no budget)'}; ceiling {r['ceiling_speedup']}x")
    with open(args.out, "w") as f:
        json.dump({"provenance": origin, **result}, f, indent=1)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
