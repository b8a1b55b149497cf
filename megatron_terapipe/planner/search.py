"""The plan search: how `solve`, terapipe-plan and the Megatron-LM flags all choose a plan.

1. Candidates: the DP's plan (`solve_slicing`, exact for its objective), the best uniform
   slicing, and no token slicing. The objective only approximates the timeline, so
2. the simulator times each in the space's weight-gradient mode: deferred to W actions by
   default (exact, and one accumulation per parameter and sequence however many token slices),
   in every backward when the caller says so, or with `defer_wgrad=None` in both, where the
   fastest of each mode stands for it (ties keep the earlier candidate: the DP's) and the
   deferred one wins only when at least DEFER_MIN_GAIN faster than the plain one, because
   deferring holds what the gradients need until the W action.
3. With `refine`, the winner is then polished against the simulated timeline: a hill climb on
   its slices (`hill_climb.refine`), a uniform slicing into fewer cells if timed within 0.5%
   (`hill_climb.fewer_cells`: per-cell work the cost model leaves out favours fewer cells), and
   early W actions (`hill_climb.place_wgrad_points`), which can make deferring pay where one W per
   sequence did not. Every step that changes the plan is kept, for callers to show.

Links: a cost model prices every stage-to-stage transfer at one link. It is the inter-node link
as soon as any two neighbouring stages sit on different nodes (`stages_cross_nodes`): every
cell crosses every boundary, so the slowest link paces the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ..plan import TeraPipePlan
from .cost.cost_model import CostModel
from .cost.dims import Hardware, Link
from .cost.stage_memory import StageMemory
from .evaluate.simulator import SimulationResult, simulate_plan
from .hill_climb import fewer_cells, place_wgrad_points
from .hill_climb import refine as hill_climb
from .slicer import (BatchSizes, SlicingSolution, best_uniform_slicing, slicing_unit,
                     solve_slicing)

#: Automatic choices defer weight gradients only when the simulator finds that at least this
#: much faster (deferring holds memory until the W action).
DEFER_MIN_GAIN = 0.01


def deferral_pays(plain_time: float, deferred_time: float) -> bool:
    """Whether deferring weight gradients is worth its memory (see DEFER_MIN_GAIN)."""
    return deferred_time < plain_time * (1.0 - DEFER_MIN_GAIN)


def stages_cross_nodes(ranks_per_stage: int, num_stages: int, gpus_per_node: int) -> bool:
    """Whether some neighbouring pipeline stages sit on different nodes. Megatron orders ranks
    TP, CP, DP, then PP: a pipeline's stages lie `ranks_per_stage` (TP x CP x DP) ranks apart,
    so it spans ranks_per_stage x num_stages ranks, and beyond one node a boundary crosses."""
    return ranks_per_stage * num_stages > gpus_per_node


def pipeline_link(hardware: Hardware, cross_nodes: bool) -> Link:
    """The link every stage-to-stage transfer is priced at (see `stages_cross_nodes`)."""
    return hardware.inter_node if cross_nodes else hardware.intra_node


@dataclass(frozen=True)
class SearchSpace:
    """One run's shape and what the search may choose from."""

    seq_length: int
    micro_batch_size: int
    num_stages: int
    num_microbatches: int = 1
    order: str = "1f1b"
    granularity: int = 8  # token slices are multiples of this ...
    multiple_of: int = 1  # ... and of this (TP size under sequence parallelism)
    batch_sizes: BatchSizes = "divisors"
    include_transfer: bool = True  # in the DP's objective
    defer_wgrad: Optional[bool] = True  # False: in every backward; None: the simulator decides
    refine: bool = True
    memory: Optional[StageMemory] = None  # what stages keep (default: the cost model's)
    # model chunks per stage the schedule table may also try (virtual_search.py), besides 1
    virtual_stages: tuple[int, ...] = ()
    # plan where W actions run (wgrad_slots.py), as terapipe-plan and the flags do by default
    place_wgrad: bool = True
    # microbatches per group of the interleaved order when the run fixes it (Megatron-LM's
    # --microbatch-group-size-per-virtual-pipeline-stage), for Megatron's rows and TeraPipe's
    microbatch_group: Optional[int] = None

    @property
    def unit(self) -> int:
        """Tokens every slice length is a multiple of."""
        return slicing_unit(self.seq_length, self.granularity, self.multiple_of)

    def simulate(self, plan: TeraPipePlan, cost_model: CostModel) -> SimulationResult:
        return simulate_plan(plan, cost_model, self.num_microbatches, self.num_stages,
                             self.micro_batch_size, memory=self.memory)


@dataclass(frozen=True)
class Candidate:
    """A plan the search timed: where it came from, the plan and its simulation."""

    name: str  # "TeraPipe DP", "uniform x60", "no token slicing", "fewer cells x29", ...
    plan: TeraPipePlan
    result: SimulationResult

    @property
    def time(self) -> float:
        return self.result.iteration_time

    @property
    def label(self) -> str:
        """The name, with " +W" for deferred weight gradients, ", early W" for W points and
        ", W placed" for planned W places."""
        text = self.name + (" +W" if self.plan.defer_wgrad else "")
        text += ", early W" if self.plan.wgrad_points else ""
        return text + (", W placed" if self.plan.wgrad_after else "")


@dataclass(frozen=True)
class SearchResult:
    """The chosen plan and how the search got there."""

    plan: TeraPipePlan  # the chosen plan, predicted_time its simulated iteration time
    chosen: Candidate
    starts: tuple[Candidate, ...]  # DP, uniform, no token slicing, in the chosen W mode
    best_start: Candidate  # the fastest of `starts`
    steps: tuple[Candidate, ...]  # what refinement changed, in order
    baseline: Candidate  # no token slicing, weight gradients in every backward (Megatron's)
    slicing: SlicingSolution  # the DP's own result

    @property
    def rows(self) -> tuple[Candidate, ...]:
        """For a comparison table: the refinements (newest first), the DP's and the uniform
        plan, no token slicing if it won in deferred mode, and the baseline last; a plan met
        again (the budget search's steps start from the starts' plans) keeps its first row."""
        dp, uniform, whole = self.starts
        extra = (whole,) if whole is self.best_start and whole.plan != self.baseline.plan else ()
        rows, seen = [], []
        for row in (*reversed(self.steps), dp, uniform, *extra, self.baseline):
            if row is self.baseline or row.plan not in seen:
                rows.append(row)
                seen.append(row.plan)
        return tuple(rows)


def choose_deferral(cost_model: CostModel, space: SearchSpace,
                    named_plans: Sequence[tuple[str, TeraPipePlan]]) -> list[Candidate]:
    """The plans, timed, all in one weight-gradient mode: `space.defer_wgrad` if it fixes one;
    otherwise deferred when the fastest deferred plan pays (`deferral_pays`) against the
    fastest plain one."""
    modes = (False, True) if space.defer_wgrad is None else (bool(space.defer_wgrad),)
    timed: dict[bool, list[Candidate]] = {}
    for mode in modes:
        plans = [(name, replace(plan, defer_wgrad=mode, wgrad_points=()))
                 for name, plan in named_plans]
        timed[mode] = [Candidate(name, plan, space.simulate(plan, cost_model))
                       for name, plan in plans]
    if len(modes) == 2 and deferral_pays(min(c.time for c in timed[False]),
                                         min(c.time for c in timed[True])):
        return timed[True]
    return timed[modes[0]]


def search(cost_model: CostModel, space: SearchSpace) -> SearchResult:
    """Choose a plan (module docstring). Raises ValueError for a space the slicer rejects."""
    slicing = solve_slicing(cost_model, space.seq_length, space.micro_batch_size,
                            space.num_stages, space.granularity, space.num_microbatches,
                            space.order, space.multiple_of, space.batch_sizes,
                            space.include_transfer)
    uniform, _ = best_uniform_slicing(cost_model, space.seq_length, space.micro_batch_size,
                                      space.num_stages, space.granularity,
                                      space.num_microbatches, space.order, space.multiple_of,
                                      space.include_transfer)
    whole = TeraPipePlan([space.seq_length], order=space.order, defer_wgrad=False)
    starts = choose_deferral(cost_model, space, [
        ("TeraPipe DP", slicing.plan), (f"uniform x{len(uniform.seq_slices)}", uniform),
        ("no token slicing", whole)])
    best = min(starts, key=lambda c: c.time)  # ties keep the earlier: the DP's
    baseline = starts[2]
    if baseline.plan.defer_wgrad:
        baseline = Candidate("no token slicing", whole, space.simulate(whole, cost_model))
    steps = refinements(cost_model, space, best) if space.refine else []
    chosen = steps[-1] if steps else best
    plan = replace(chosen.plan, order=space.order, predicted_time=chosen.time)
    return SearchResult(plan, chosen, tuple(starts), best, tuple(steps), baseline, slicing)


def refinements(cost_model: CostModel, space: SearchSpace, start: Candidate) -> list[Candidate]:
    """The plans refinement moves to from `start`, each timed: hill climb, fewer cells, early
    W actions (steps that change nothing are left out)."""
    shape = (space.num_microbatches, space.num_stages, space.micro_batch_size)
    steps: list[Candidate] = []
    current = start
    refined, _ = hill_climb(current.plan, cost_model, *shape, space.unit)
    if refined.token_slices != current.plan.token_slices:
        current = Candidate("refined " + current.name, refined, space.simulate(refined, cost_model))
        steps.append(current)
    fewer, _ = fewer_cells(current.plan, cost_model, *shape, space.unit)
    if fewer.token_slices != current.plan.token_slices:
        current = Candidate(f"fewer cells x{len(fewer.seq_slices)}", fewer,
                            space.simulate(fewer, cost_model))
        steps.append(current)
    early = _early_w(cost_model, space, current)
    if early is not None:
        steps.append(early)
    return steps


def _early_w(cost_model: CostModel, space: SearchSpace, current: Candidate) -> Optional[Candidate]:
    """`current` with early W actions where they shorten the simulated timeline. A plan with
    weight gradients in every backward takes them (and deferral) only when the mode is
    automatic and they make deferring pay."""
    if space.defer_wgrad is False:
        return None
    placed, placed_time = place_wgrad_points(
        replace(current.plan, defer_wgrad=True), cost_model, space.num_microbatches,
        space.num_stages, space.micro_batch_size)
    if current.plan.defer_wgrad:
        take = bool(placed.wgrad_points)
    else:
        take = space.defer_wgrad is None and deferral_pays(current.time, placed_time)
    return Candidate(current.name, placed, space.simulate(placed, cost_model)) if take else None


def solve(cost_model: CostModel, seq_length: int, micro_batch_size: int, num_stages: int,
          granularity: int = 8, num_microbatches: int = 1, order: str = "1f1b",
          multiple_of: int = 1, batch_sizes: BatchSizes = "divisors",
          include_transfer: bool = True, simulate: bool = True,
          defer_wgrad: Optional[bool] = True, refine: bool = True) -> TeraPipePlan:
    """The plan `search` chooses, its predicted_time the simulator's iteration time: never
    slower than the best uniform slicing or no token slicing under the simulator (within the
    0.5% that fewer cells may cost). defer_wgrad: True (the default) or False fixes it, None
    lets the simulator decide. With simulate=False: the DP's plan alone, its objective as
    predicted_time."""
    space = SearchSpace(seq_length, micro_batch_size, num_stages, num_microbatches, order,
                        granularity, multiple_of, batch_sizes, include_transfer, defer_wgrad,
                        refine)
    if simulate:
        return search(cost_model, space).plan
    solution = solve_slicing(cost_model, seq_length, micro_batch_size, num_stages, granularity,
                             num_microbatches, order, multiple_of, batch_sizes, include_transfer)
    return replace(solution.plan, defer_wgrad=bool(defer_wgrad),
                   predicted_time=solution.objective)
