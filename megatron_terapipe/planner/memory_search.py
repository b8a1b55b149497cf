"""Plans that fit a memory budget: the plan search (search.py) with every candidate's
predicted peak per stage (activations and K/V by the space's StageMemory, plus the model
state) held against a per-GPU budget.

1. The unconstrained search; if its plan fits, it stands.
2. Otherwise, plans that keep less alive: near-equal token slicings from 1 slice up (a 1f1b
   stage holds about one microbatch plus a few cells, so smaller cells hold less), each with
   the rows in one batch slice or cut into smaller ones, in the space's weight-gradient mode
   (both modes when it is automatic: deferring holds more). The fastest that fits wins.
3. Refinement (hill climb, fewer cells) polishes it; a step counts only if it still fits.
4. With `SearchSpace.place_wgrad`, the chosen plan's W actions are placed where its stages
   would wait (wgrad_slots.py), within the budget, when that is faster; with many
   microbatches, whole sequences with the first and last ones cut (edge_search.py) are
   tried too, and win when faster.
If nothing fits, MemoryBudgetError names the smallest peak found and what to change.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from ..plan import TeraPipePlan
from ..schedule import build_schedule
from .cost.cost_model import CostModel
from .cost.stage_memory import MemoryBudget, MemoryBudgetError, format_size
from .evaluate.list_estimate import ListCaches, ListEstimate, estimate_lists, shared_caches
from .edge_search import with_edge_slices
from .hill_climb import fewer_cells
from .hill_climb import refine as hill_climb
from .search import Candidate, SearchResult, SearchSpace, search
from .slicer import cell_arrays
from .wgrad_slots import plan_wgrad

MAX_CANDIDATES = 120  # simulations of step 2


def fits(candidate: Candidate, budget: MemoryBudget) -> bool:
    return budget.fits(candidate.result.peak_memory_bytes)


def peak_total(candidate: Candidate, budget: MemoryBudget) -> float:
    """The candidate's largest predicted peak over the stages, model state included."""
    return max(budget.totals(candidate.result.peak_memory_bytes))


def _slice_counts(space: SearchSpace) -> list[int]:
    """1, 2, 4, ... token slices up to the most the slicing unit allows."""
    most = space.seq_length // space.unit
    counts, n = [], 1
    while n < most:
        counts.append(n)
        n *= 2
    return counts + [most]


def _row_splits(space: SearchSpace) -> list[Optional[tuple[int, ...]]]:
    """All rows in one batch slice, or equal batch slices of each smaller divisor."""
    if space.batch_sizes == "none":
        return [None]
    rows = space.micro_batch_size
    return [None] + [tuple([d] * (rows // d)) for d in range(rows - 1, 0, -1) if rows % d == 0]


def leaner_plans(space: SearchSpace) -> list[tuple[str, TeraPipePlan]]:
    """Step 2's plans, named (at most MAX_CANDIDATES, fewest cells first)."""
    modes = (False, True) if space.defer_wgrad is None else (bool(space.defer_wgrad),)
    out: list[tuple[str, TeraPipePlan]] = []
    for n in _slice_counts(space):
        for rows in _row_splits(space):
            for mode in modes:
                if len(out) >= MAX_CANDIDATES:
                    return out
                plan = replace(TeraPipePlan.uniform(space.seq_length, n, space.order,
                                                    space.unit, rows), defer_wgrad=mode)
                out.append((f"uniform x{n}" + (f", batch slices of {rows[0]}" if rows else ""),
                            plan))
    return out


def leaner_candidates(cost_model: CostModel, space: SearchSpace) -> list[Candidate]:
    """Step 2's plans, every one timed (the reference `fastest_leaner` must agree with)."""
    return [Candidate(name, plan, space.simulate(plan, cost_model))
            for name, plan in leaner_plans(space)]


def _estimate(cost_model: CostModel, space: SearchSpace, plan: TeraPipePlan,
              caches: ListCaches) -> ListEstimate:
    schedule = build_schedule(plan, space.num_microbatches, space.num_stages,
                              space.micro_batch_size)
    return estimate_lists(schedule, cost_model, space.memory, caches, with_times=False)


def compute_floor(cost_model: CostModel, space: SearchSpace, plan: TeraPipePlan) -> float:
    """A lower bound of every stage's compute under `plan`, from its cells' layer times alone,
    in a few array calls: edges and W actions cost >= 0, and a deferred backward saves at
    most the largest saving of any stage kind. Below the list estimate's busiest compute,
    so below the simulated time (the 1e-9 margin covers rounding)."""
    b, l, c = cell_arrays(plan, space.micro_batch_size)
    backward = np.asarray(cost_model.backward_time(b, l, c), dtype=float)
    if plan.defer_wgrad:
        saving = np.max([np.asarray(cost_model.deferred_backward_saving(b, l, c, first, last))
                         for first in (False, True) for last in (False, True)], axis=0)
        backward = np.maximum(0.0, backward - saving)
    forward = np.asarray(cost_model.forward_time(b, l, c), dtype=float)
    return space.num_microbatches * float(forward.sum() + backward.sum()) * (1.0 - 1e-9)


def fastest_leaner(cost_model: CostModel, space: SearchSpace,
                   budget: MemoryBudget) -> tuple[Optional[Candidate], Optional[Candidate]]:
    """(the fastest of step 2's plans that fits, None; or None, the leanest), timing only
    what can matter. Plans are taken in order of their compute floor (`compute_floor`, no
    schedule built) until it passes the fastest found; each one's exact peaks come from its
    lists (`estimate_lists`, without times), and those that fit are timed. The same choice as
    timing every plan (`leaner_candidates`), ties going to the earlier plan as there; only when
    nothing fits are all plans estimated, for the leanest."""
    plans = leaner_plans(space)
    caches = shared_caches(cost_model, space.memory)
    floors = [compute_floor(cost_model, space, plan) for _, plan in plans]
    estimates: dict[int, ListEstimate] = {}

    def estimate(i: int) -> ListEstimate:
        if i not in estimates:
            estimates[i] = _estimate(cost_model, space, plans[i][1], caches)
        return estimates[i]

    def timed(i: int) -> Candidate:
        return Candidate(plans[i][0], plans[i][1], space.simulate(plans[i][1], cost_model))

    best: Optional[tuple[float, int, Candidate]] = None
    for i in sorted(range(len(plans)), key=lambda i: (floors[i], i)):
        if best is not None and floors[i] > best[0]:
            break  # this plan and every later one take longer than the fastest found
        found = estimate(i)
        if not budget.fits(found.peak_memory_bytes):
            continue
        candidate = timed(i)
        if best is None or (candidate.time, i) < best[:2]:
            best = (candidate.time, i, candidate)
    if best is None:  # nothing fits: the leanest, timed, for the error and the schedule table
        lean = min(range(len(plans)), key=lambda i: max(budget.totals(estimate(i).peak_memory_bytes)))
        return None, timed(lean)
    return best[2], None


def _polished(cost_model: CostModel, space: SearchSpace, start: Candidate,
              budget: MemoryBudget) -> list[Candidate]:
    """Hill climb and fewer cells from `start`, each step kept only if it still fits."""
    shape = (space.num_microbatches, space.num_stages, space.micro_batch_size)
    steps, current = [], start
    climbed, _ = hill_climb(current.plan, cost_model, *shape, space.unit)
    for name, plan in (("refined " + start.name, climbed), ("fewer cells", None)):
        if plan is None:
            plan, _ = fewer_cells(current.plan, cost_model, *shape, space.unit)
            name = f"fewer cells x{len(plan.seq_slices)}"
        if plan.token_slices == current.plan.token_slices:
            continue
        candidate = Candidate(name, plan, space.simulate(plan, cost_model))
        if fits(candidate, budget) and candidate.time <= current.time * 1.005:
            steps.append(candidate)
            current = candidate
    return steps


def search_within_budget(cost_model: CostModel, space: SearchSpace,
                         budget: MemoryBudget) -> SearchResult:
    """The search's plan if it fits `budget`, else the fastest plan of steps 2-3 that does;
    with `space.place_wgrad`, its W actions then placed (step 4). Raises MemoryBudgetError
    when none fits."""
    result = _fitting(cost_model, space, budget)
    if not space.place_wgrad:
        return result
    placed = with_placed_wgrad(cost_model, space, budget, result)
    return with_edge_slices(cost_model, space, budget, placed)


def with_placed_wgrad(cost_model: CostModel, space: SearchSpace, budget: MemoryBudget,
                      result: SearchResult) -> SearchResult:
    """Step 4: the chosen plan with its W actions placed where its stages would wait
    (wgrad_slots.py), as one more step, when that is faster: never slower, and within
    the budget wherever the chosen plan is."""
    chosen = result.chosen
    if not chosen.plan.defer_wgrad:
        return result
    placed, _ = plan_wgrad(chosen.plan, cost_model, space.num_microbatches, space.num_stages,
                           space.micro_batch_size, budget, space.memory,
                           cache=shared_caches(cost_model, None).costs)
    if not placed.wgrad_after:
        return result
    step = Candidate(chosen.name, placed, space.simulate(placed, cost_model))
    plan = replace(placed, order=space.order, predicted_time=step.time)
    return replace(result, plan=plan, chosen=step, steps=(*result.steps, step))


def _fitting(cost_model: CostModel, space: SearchSpace, budget: MemoryBudget) -> SearchResult:
    base = search(cost_model, space)
    if budget.budget_bytes is None or fits(base.chosen, budget):
        return base
    best, leanest = fastest_leaner(cost_model, space, budget)
    if best is None:
        leanest = min([leanest, base.chosen], key=lambda c: peak_total(c, budget))
        error = MemoryBudgetError(no_fit_message(space, budget, leanest))
        error.leanest = leanest  # type: ignore[attr-defined]
        raise error
    steps = (best, *(_polished(cost_model, space, best, budget) if space.refine else ()))
    chosen = steps[-1]
    plan = replace(chosen.plan, order=space.order, predicted_time=chosen.time)
    return SearchResult(plan, chosen, base.starts, base.best_start, (base.chosen, *steps),
                        base.baseline, base.slicing)


def no_fit_message(space: SearchSpace, budget: MemoryBudget, leanest: Candidate) -> str:
    totals = budget.totals(leanest.result.peak_memory_bytes)
    stage = max(range(len(totals)), key=lambda k: totals[k])
    fixes = "more memory, more pipeline stages, a smaller micro batch"
    if space.order != "1f1b":
        fixes += ", order 1f1b (it keeps about one microbatch per stage)"
    return (f"no {space.order} plan fits the memory budget of {format_size(budget.budget_bytes)} "
            f"per GPU: the leanest ({leanest.label}) peaks at {format_size(totals[stage])} on "
            f"stage {stage} ({format_size(leanest.result.peak_memory_bytes[stage])} of "
            f"activations and K/V, {format_size(budget.state(stage))} of weights, gradients and "
            f"optimizer state); give {fixes}, or recompute activations (Megatron's "
            "--recompute-granularity full with --recompute-method uniform keeps the least; "
            "the planner counts what it saves)")
