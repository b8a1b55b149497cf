"""Edge slicing as a planned decision (`TeraPipePlan.edge_slices`): with many microbatches
the planner's best 1f1b plan often cuts no sequence, and what it loses to a schedule with no
bubble is the fill and the drain: a whole sequence takes K - 1 hops of a whole forward to
reach the last stage, and the last backwards as long to come back. Cutting only the first
and last few microbatches into token slices shortens both at the price of a few cells' fixed
costs, while the middle runs whole, as Megatron's 1F1B (the order keeps K - k sequences in
flight on stage k: schedule/orders.py).

The search walks (first microbatches cut, their slices, last microbatches cut, theirs) from
(2, 2, 2, 2) (within its bounds: a quarter of the microbatches at each end, 2 to 8 slices) to
the best neighbour (one of them one more or one fewer) until none is faster,
every candidate with its W actions placed (wgrad_slots.py) and held to the budget. Each
candidate is one simulation per placement policy, so the walk runs only where it can pay:
1f1b, deferred weight gradients, one chunk per rank, at least 2K microbatches.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..plan import TeraPipePlan
from ..schedule import build_schedule
from .cost.cost_model import CostModel
from .cost.stage_memory import MemoryBudget
from .evaluate.list_estimate import ListCaches, estimate_lists, shared_caches
from .search import Candidate, SearchResult, SearchSpace
from .wgrad_slots import plan_wgrad

Edges = tuple[int, int, int, int]  # first microbatches cut, their slices, last ones, theirs
START: Edges = (2, 2, 2, 2)
MOST_SLICES = 8


def applies(space: SearchSpace) -> bool:
    """Whether the walk runs for this space (module docstring)."""
    return (space.place_wgrad and space.order == "1f1b" and space.defer_wgrad is not False
            and space.num_microbatches >= 2 * space.num_stages and space.num_stages > 1
            and space.seq_length // space.unit >= 2)


def edge_plan(space: SearchSpace, edges: Edges) -> TeraPipePlan:
    """Whole sequences, the first and last microbatches cut into near-equal slices."""
    first, n_first, last, n_last = edges
    cut = [list(TeraPipePlan.uniform(space.seq_length, n, multiple_of=space.unit).seq_slices)
           for n in (n_first, n_last)]
    return TeraPipePlan([space.seq_length], order="1f1b", defer_wgrad=True,
                        edge_slices=((first, cut[0]), (last, cut[1])))


def _bounds(space: SearchSpace) -> tuple[Edges, Edges]:
    """(lows, highs) of the walk: up to a quarter of the microbatches cut at each end, into
    2 to MOST_SLICES slices (as many as whole slicing units allow)."""
    most = min(MOST_SLICES, space.seq_length // space.unit)
    quarter = space.num_microbatches // 4
    return (0, 2, 0, 2), (quarter, most, quarter, most)


def _start(space: SearchSpace) -> Edges:
    lows, highs = _bounds(space)
    return tuple(max(lo, min(v, hi)) for v, lo, hi in zip(START, lows, highs))


def _neighbours(edges: Edges, space: SearchSpace) -> list[Edges]:
    lows, highs = _bounds(space)
    out = []
    for i in range(4):
        for step in (-1, 1):
            value = edges[i] + step
            if lows[i] <= value <= highs[i]:
                out.append(edges[:i] + (value,) + edges[i + 1:])
    return out


class _Timer:
    """Each candidate's time with its W places, within the budget (None: over it)."""

    def __init__(self, cost_model: CostModel, space: SearchSpace, budget: MemoryBudget):
        self.cost_model, self.space, self.budget = cost_model, space, budget
        self.caches: ListCaches = shared_caches(cost_model, space.memory)
        self.known: dict[Edges, tuple[Optional[TeraPipePlan], float]] = {}

    def __call__(self, edges: Edges) -> tuple[Optional[TeraPipePlan], float]:
        if edges not in self.known:
            self.known[edges] = self._timed(edges)
        return self.known[edges]

    def _timed(self, edges: Edges) -> tuple[Optional[TeraPipePlan], float]:
        s, plan = self.space, edge_plan(self.space, edges)
        shape = (s.num_microbatches, s.num_stages, s.micro_batch_size)
        if self.budget.budget_bytes is not None:
            peaks = estimate_lists(build_schedule(plan, *shape), self.cost_model, s.memory,
                                   self.caches, with_times=False).peak_memory_bytes
            if not self.budget.fits(peaks):
                return None, float("inf")
        return plan_wgrad(plan, self.cost_model, *shape, self.budget, s.memory,
                          cache=self.caches.costs)


def best_edge_plan(cost_model: CostModel, space: SearchSpace, budget: MemoryBudget
                   ) -> tuple[Optional[TeraPipePlan], float, Edges]:
    """(plan with its W places, seconds, edges) where the walk ends (module docstring); the
    plan None (seconds inf) when no candidate fits the budget."""
    timer = _Timer(cost_model, space, budget)
    best = _start(space)
    while True:
        step = min(_neighbours(best, space), key=lambda e: timer(e)[1], default=best)
        if timer(step)[1] >= timer(best)[1]:
            break
        best = step
    return (*timer(best), best)


def with_edge_slices(cost_model: CostModel, space: SearchSpace, budget: MemoryBudget,
                     result: SearchResult) -> SearchResult:
    """`result` with an edge-sliced plan as one more step where one is faster (module
    docstring); `result` itself otherwise."""
    if not applies(space):
        return result
    plan, seconds, best = best_edge_plan(cost_model, space, budget)
    if plan is None or seconds >= result.chosen.time:
        return result
    name = (f"edges cut ({best[0]} x{best[1]}, {best[2]} x{best[3]})" if plan.edge_slices
            else "no token slicing")  # the walk may end with no edge cut
    step = Candidate(name, plan, space.simulate(plan, cost_model))
    plan = replace(plan, predicted_time=step.time)
    return replace(result, plan=plan, chosen=step, steps=(*result.steps, step))
