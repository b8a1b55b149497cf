"""Simulator-guided refinement: polish a plan's token slices against the simulated timeline.

The DP is exact for its objective, M * sum + (K-1) * max on the slowest kind of stage. That
objective abstracts the pipeline: it does not see that only the first slice's forward on the
first stage fills the pipeline and only the last slice's backward on the last stage drains it,
that the stages' edge costs differ, or where deferred weight gradients land. `refine` starts from
a plan and climbs: each step tries every move of one slicing unit between neighbouring slices,
every split of a slice in two and every merge of two neighbours, and keeps the move that lowers
the simulated iteration time most, if it gains at least `min_gain` (relative; smaller gains are
within any cost model's error and would only make the plan ragged). It stops at a local
optimum or after `max_evaluations` simulations, so it is never worse than its start under the
simulator.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from ..plan import TeraPipePlan
from .cost.cost_model import CostModel
from .evaluate.list_estimate import shared_caches
from .evaluate.simulator import plan_time

#: Refinement simulates the whole schedule per candidate; past this many actions it is skipped.
MAX_ACTIONS = 20_000


def _neighbours(units: tuple[int, ...]) -> list[tuple[int, ...]]:
    out = []
    n = len(units)
    for i in range(n - 1):
        if units[i] > 1:  # one unit from slice i to slice i + 1
            out.append(units[:i] + (units[i] - 1, units[i + 1] + 1) + units[i + 2:])
        if units[i + 1] > 1:  # and back
            out.append(units[:i] + (units[i] + 1, units[i + 1] - 1) + units[i + 2:])
        out.append(units[:i] + (units[i] + units[i + 1],) + units[i + 2:])  # merge
    for i, u in enumerate(units):
        if u > 1:  # split, the larger half first
            out.append(units[:i] + (u - u // 2, u // 2) + units[i + 1:])
    return out


def _timer(cost_model: CostModel, num_microbatches: int, num_stages: int, micro_batch_size: int,
           cores: Optional[float]) -> Callable[[TeraPipePlan], float]:
    """plan -> its simulated iteration time, for one run's shape; each plan simulated once
    (a climb meets the same plan again), the cost model's answers shared."""
    costs = shared_caches(cost_model, None).costs
    times: dict = {}

    def time(plan: TeraPipePlan) -> float:
        key = (plan.token_slices, tuple(plan.batch_slices or ()), plan.order, plan.defer_wgrad,
               tuple(tuple(p) for p in plan.wgrad_points))
        if key not in times:
            times[key] = plan_time(plan, cost_model, num_microbatches, num_stages,
                                   micro_batch_size, cores, costs)
        return times[key]

    return time


def _too_large(plan: TeraPipePlan, num_microbatches: int, num_stages: int) -> bool:
    """Whether simulating `plan` per candidate would take too long (MAX_ACTIONS)."""
    return plan.num_cells * num_microbatches * num_stages * 3 > MAX_ACTIONS


def _reslicable(plan: TeraPipePlan, num_microbatches: int, num_stages: int, unit: int) -> bool:
    """Whether refine and fewer_cells may cut `plan` anew: one token slicing shared by its
    batch slices, a positive unit, and cheap enough to simulate per candidate."""
    return plan.uniform_token_slicing and unit > 0 and not _too_large(plan, num_microbatches,
                                                                      num_stages)


def _with_slices(plan: TeraPipePlan, slices: list[int], **changes) -> TeraPipePlan:
    """`plan` cut into `slices`, keeping the early W actions that still name a slice."""
    points = [[j for j in p if j < len(slices)] for p in plan.wgrad_points]
    return replace(plan, seq_slices=slices, wgrad_points=points, **changes)


def refine(plan: TeraPipePlan, cost_model: CostModel, num_microbatches: int, num_stages: int,
           micro_batch_size: int, unit: int, max_evaluations: int = 200,
           cores: Optional[float] = None, min_gain: float = 5e-3) -> tuple[TeraPipePlan, float]:
    """The best plan the climb reaches from `plan`, and its simulated iteration time.

    Only plans whose batch slices share one token slicing are refined (others come back as
    they are); slices stay multiples of `unit` tokens. The plan's order, batch slices and
    weight-gradient deferral are kept.
    """
    timed = _timer(cost_model, num_microbatches, num_stages, micro_batch_size, cores)

    start_time = timed(plan)
    if not _reslicable(plan, num_microbatches, num_stages, unit):
        return plan, start_time
    if any(t % unit for t in plan.token_slices[0]):
        return plan, start_time
    units = tuple(t // unit for t in plan.token_slices[0])
    best_units, best_time = units, start_time
    seen = {units}
    evaluations = 0
    while evaluations < max_evaluations:
        step_units, step_time = best_units, best_time
        for candidate in _neighbours(best_units):
            if candidate in seen:
                continue
            seen.add(candidate)
            t = timed(_with_slices(plan, [u * unit for u in candidate]))
            evaluations += 1
            if t < step_time and t < best_time * (1.0 - min_gain):
                step_units, step_time = candidate, t
            if evaluations >= max_evaluations:
                break
        if step_units == best_units:
            break
        best_units, best_time = step_units, step_time
    refined = _with_slices(plan, [u * unit for u in best_units], predicted_time=best_time)
    return refined, best_time


def place_wgrad_points(plan: TeraPipePlan, cost_model: CostModel, num_microbatches: int,
                       num_stages: int, micro_batch_size: int, max_evaluations: int = 200,
                       cores: Optional[float] = None, min_gain: float = 5e-3
                       ) -> tuple[TeraPipePlan, float]:
    """Early W actions where the simulated timeline gains from them, and the plan's time.

    A stage whose backward cells are shorter than its successor's waits for each output
    gradient; an early W (after the backward of a given token slice, `TeraPipePlan.wgrad_points`)
    spends that wait on weight gradients that would otherwise all run after the sequence's
    last backward, on the critical path. Greedy: each step adds the (stage, token slice) that
    lowers the simulated iteration time most, by at least `min_gain`. Plans without deferred
    weight gradients, or too large to simulate often (MAX_ACTIONS), come back unchanged.
    """
    timed = _timer(cost_model, num_microbatches, num_stages, micro_batch_size, cores)

    best_time = timed(plan)
    if not plan.defer_wgrad or _too_large(plan, num_microbatches, num_stages):
        return plan, best_time
    most = max(len(ts) for ts in plan.token_slices)
    points = [set(plan.wgrad_points_of(k)) for k in range(num_stages)]
    evaluations = 0
    while evaluations < max_evaluations:
        step = None
        for k in range(num_stages):
            for j in range(1, most):
                if j in points[k] or evaluations >= max_evaluations:
                    continue
                trial = [sorted(p | {j}) if i == k else sorted(p) for i, p in enumerate(points)]
                t = timed(replace(plan, wgrad_points=trial))
                evaluations += 1
                if t < best_time * (1.0 - min_gain) and (step is None or t < step[0]):
                    step = (t, k, j)
        if step is None:
            break
        best_time, k, j = step
        points[k].add(j)
    placed = replace(plan, wgrad_points=[sorted(p) for p in points], predicted_time=best_time)
    return placed, best_time


def fewer_cells(plan: TeraPipePlan, cost_model: CostModel, num_microbatches: int,
                num_stages: int, micro_batch_size: int, unit: int, tolerance: float = 5e-3,
                max_candidates: int = 16, cores: Optional[float] = None
                ) -> tuple[TeraPipePlan, float]:
    """The plan with the fewest token slices that the simulator times within `tolerance` of
    `plan`, and its time: `plan` itself, or a uniform slicing into fewer slices (at most
    `max_candidates` counts between half of `plan`'s and one less; same order, batch slices and
    weight-gradient mode, no early W actions).

    Work a cost model leaves out (Python and kernel launches around each cell, per-message
    transport costs) grows with the number of cells; where the simulator cannot tell plans
    apart, fewer cells is the safer choice. (On the benchmark's CPU, 9-11 slices measured 2-5%
    faster than a 14-slice plan the simulator timed within 0.6% of them.) Plans whose batch
    slices are cut differently, or too large to simulate often, come back unchanged.
    """
    timed = _timer(cost_model, num_microbatches, num_stages, micro_batch_size, cores)

    plan_t = timed(plan)
    if not _reslicable(plan, num_microbatches, num_stages, unit):
        return plan, plan_t
    count = len(plan.token_slices[0])
    seq_length = sum(plan.token_slices[0])
    counts = range((count + 1) // 2, min(count, seq_length // unit + 1))
    if len(counts) > max_candidates:  # evenly spaced, both ends kept
        step = (len(counts) - 1) / (max_candidates - 1)
        counts = sorted({counts[round(i * step)] for i in range(max_candidates)})
    for n in counts:  # fewest first: the first within the tolerance wins
        candidate = replace(plan, seq_slices=TeraPipePlan.uniform(seq_length, n, multiple_of=unit).seq_slices,
                            wgrad_points=())
        t = timed(candidate)
        if t <= plan_t * (1.0 + tolerance):
            return replace(candidate, predicted_time=t), t
    return plan, plan_t
