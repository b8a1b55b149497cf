"""What-if: full recomputation on some (stage, model chunk) pairs only, where memory binds and
the stage has compute to spare, at 32 microbatches on 5 chunks, simulated.

    python benchmarks/bench_stage_recompute.py [--microbatches 32]
        [--out benchmarks/results/cpu/stage_recompute.json]

The question of bench_virtual_stages.py (gpt3-13b, H100 preset, 8 stages x TP 8, seq 8192,
micro batch 1; budget: 20 GiB or Megatron 1F1B's own peak, whichever is larger), whole
sequences on 5 one-layer chunks per stage, deferred W, Megatron's interleaved order in groups
(virtual_group) with each warm-up (virtual_warmup). Megatron's recomputation flags act on every
chunk of every stage; the busiest stage (the last: it runs the output layer) has no compute to
spare, the others about 90 ms of 990 at 32 microbatches, and a chunk's activations are held
longest on the chunks that enter the ring first. So the idea priced here: recompute only the
chunks of the stages over the budget, the earliest chunk first, until each fits (a greedy
walk; at most every chunk). The planner cannot plan this (its cost and memory models take
one recomputation for all stages): the script prices it by adding the chunk's rerun forward to
those pairs' backward cells (the simulator's `CellCosts.compute`) and walking those pairs'
cells with the recomputing memory model (`MemoryWalk.cell_value`), both patched inside
`recompute_on`, restored after. Then W places within the budget where the plan fits (else with
none), as terapipe-plan places them. Everything is simulated: no GPU is involved; the JSON
starts with its provenance (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_virtual_limits import plan_of, question  # noqa: E402
from megatron_terapipe.planner.cost.recompute_time import FullRecompute  # noqa: E402
from megatron_terapipe.planner.cost.recompute_memory import memory_of  # noqa: E402
from megatron_terapipe.planner.cost.stage_memory import GiB  # noqa: E402
from megatron_terapipe.planner.evaluate import memory_walk, simulator  # noqa: E402
from megatron_terapipe.planner.wgrad_slots import plan_wgrad  # noqa: E402
from megatron_terapipe.schedule import build_schedule  # noqa: E402
from provenance import provenance, script_command  # noqa: E402

CHUNKS, STAGES = 5, 8
GROUPS = (8, 11, 16)
WARMUPS = (None, 3, 1, 0)


@contextlib.contextmanager
def recompute_on(pairs: set, cost_model):
    """While inside, the backward cells of the (stage, chunk) `pairs` rerun their chunk's
    forward (uniform recomputation, one layer per group) and keep what it keeps."""
    memory = memory_of(cost_model.with_recompute(FullRecompute("uniform", 1)))
    cache: dict = {}
    compute, cell_value = simulator.CellCosts.compute, memory_walk.MemoryWalk.cell_value

    def patched_compute(self, stage, action):
        seconds = compute(self, stage, action)
        c = action.cell
        if action.kind == "B" and (stage, getattr(c, "chunk", -1)) in pairs:
            seconds += c.share * self.cost_model.forward_time(c.rows, c.tokens, c.context)
        return seconds

    def patched_value(self, what, cell):
        if (self.stage, getattr(cell, "chunk", -1)) not in pairs:
            return cell_value(self, what, cell)
        own = self.memory, self._cache
        self.memory, self._cache = memory, cache
        try:
            return cell_value(self, what, cell)
        finally:
            self.memory, self._cache = own

    simulator.CellCosts.compute = patched_compute
    memory_walk.MemoryWalk.cell_value = patched_value
    try:
        yield
    finally:
        simulator.CellCosts.compute, memory_walk.MemoryWalk.cell_value = compute, cell_value


def priced(run, plan, pairs: set, microbatches: int):
    """Simulation of `plan` with recomputation on `pairs`."""
    with recompute_on(pairs, run.cost_model):
        return simulator.simulate(build_schedule(plan, microbatches, STAGES, 1), run.cost_model,
                                  memory=memory_of(run.cost_model))


def greedy_row(run, free, base: float, microbatches: int, group: int, warmup) -> dict:
    """Recompute the earliest chunk not yet recomputed on every stage over the budget until
    all fit or every chunk of an over-budget stage recomputes; then place W."""
    plan = plan_of(1, virtual_group=group, virtual_warmup=warmup)
    pairs: set = set()
    plain = result = priced(run, plan, pairs, microbatches)
    while not run.budget.fits(result.peak_memory_bytes):
        totals = run.budget.totals(result.peak_memory_bytes)
        over = [k for k in range(STAGES) if totals[k] > run.budget.budget_bytes]
        added = {(k, min(c for c in range(CHUNKS) if (k, c) not in pairs)) for k in over
                 if any((k, c) not in pairs for c in range(CHUNKS))}
        if not added:
            break
        pairs |= added
        result = priced(run, plan, pairs, microbatches)
    fits = run.budget.fits(result.peak_memory_bytes)
    with recompute_on(pairs, run.cost_model):
        _, placed = plan_wgrad(plan, run.cost_model, microbatches, STAGES, 1,
                               run.budget if fits else free.budget, memory_of(run.cost_model),
                               default_time=result.iteration_time)
    return {"group": group, "warmup": warmup,
            "plain_speedup": round(base / plain.iteration_time, 4),
            "plain_peak_gib": [round(t / GiB, 2) for t in run.budget.totals(plain.peak_memory_bytes)],
            "recomputed": sorted(pairs), "fits": fits,
            "peak_gib": [round(t / GiB, 2) for t in run.budget.totals(result.peak_memory_bytes)],
            "busy_ms": [round(b * 1e3, 1) for b in result.busy],
            "speedup": round(base / result.iteration_time, 4),
            "speedup_w_placed": round(base / placed, 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "cpu", "stage_recompute.json"))
    args = p.parse_args(argv)
    origin = provenance(script_command(__file__, argv))
    free, run, base, budget = question(args.microbatches)
    rows = [greedy_row(run, free, base, args.microbatches, g, w) for g in GROUPS for w in WARMUPS]
    for r in rows:
        print(f"groups of {r['group']}, warm-up {r['warmup']}: without {r['plain_speedup']}x "
              f"(peaks {' '.join(map(str, r['plain_peak_gib']))} GiB); recomputing "
              f"{len(r['recomputed'])} (stage, chunk) pairs {r['recomputed']}: "
              f"{'fits' if r['fits'] else 'over'} (peaks {' '.join(map(str, r['peak_gib']))}), "
              f"{r['speedup']}x, W placed {r['speedup_w_placed']}x"
              f"{'' if r['fits'] else ' (no budget)'}; busiest stage {max(r['busy_ms'])} ms")
    best = max((r for r in rows if r["fits"]), key=lambda r: r["speedup_w_placed"], default=None)
    result = {"microbatches": args.microbatches, "budget_gib": round(budget / GiB, 3),
              "megatron_1f1b_ms": round(base * 1e3, 3), "rows": rows,
              "best_fitting": best}
    if best is not None:
        print(f"best within {result['budget_gib']} GiB: groups of {best['group']}, warm-up "
              f"{best['warmup']}, {best['speedup_w_placed']}x over Megatron 1F1B "
              f"({result['megatron_1f1b_ms']} ms)")
    with open(args.out, "w") as f:
        json.dump({"provenance": origin, **result}, f, indent=1)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
