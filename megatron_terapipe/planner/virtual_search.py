"""Plans on virtual stages: V model chunks per rank (TeraPipePlan.virtual_stages), token
slices and W places chosen together within a memory budget.

The DP slicer's objective prices a pipeline of K stages; on K * V virtual stages the fill
shrinks and each cell crosses more links, so the search here times plans instead:
1. candidates: near-equal slicings into a few slice counts (1, 2, 3, 4, 6, 8, 12, 16, and
   the count of the one-chunk plan `hint` with its neighbours), each with the interleaved
   order's groups that matter (the fewest microbatches that give every group K units, the
   next larger group allowed, and one group of all microbatches: more units in flight
   keep the first rank busy while a unit goes round the ring, and keep more memory), in the
   space's weight-gradient mode(s);
2. taken in order of their compute floor (memory_search.compute_floor: no schedule built)
   until it passes the fastest timed so far; each one's exact peaks and busiest stage's
   compute from its lists (evaluate/list_estimate), and those that fit timed by the simulator unless
   that compute already passes the fastest;
   a 1f1b plan that does not fit is tried with a shorter warm-up (virtual_warmup 1, then 0:
   fewer activations alive, as fast when one group holds every microbatch);
3. with `SearchSpace.place_wgrad`, the fastest few then get their W actions placed
   (wgrad_slots.py), within the budget; the fastest of all is chosen.
In a V (`placement` "v": 2 chunks, rank k holding virtual stages k and 2K - 1 - k, v_order.py)
there are no groups: each slicing is tried with each of V_LEADS units in flight on rank 0
beyond K + C - 1 (`virtual_warmup`: more cover the turn and the way back, and hold more).
If nothing fits, MemoryBudgetError names the leanest plan (kept on the error as `leanest`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..plan import TeraPipePlan
from ..schedule import build_schedule
from ..schedule.build import allowed_group, virtual_group
from .cost.cost_model import CostModel
from .cost.stage_memory import MemoryBudget, MemoryBudgetError, format_size
from .evaluate.list_estimate import estimate_lists, shared_caches
from .evaluate.simulator import plan_time
from .memory_search import compute_floor
from .search import Candidate, SearchSpace
from .wgrad_slots import plan_wgrad

SLICE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16)
PLACED = 2  # the fastest fitting plans whose W actions are placed
V_LEADS = (0, 1, 2, 4)  # a V's units in flight on rank 0 beyond K + C - 1
LEAD_REACH = 1.15  # shorter warm-ups are tried for plans that pass the budget by less


@dataclass(frozen=True)
class VirtualSearchResult:
    """The chosen plan on virtual stages and the plans timed on the way (fastest first)."""

    chosen: Candidate
    timed: tuple[tuple[str, float], ...]  # (name, simulated seconds) of the plans that fit

    @property
    def plan(self) -> TeraPipePlan:
        return self.chosen.plan


def group_options(space: SearchSpace, plan: TeraPipePlan) -> list[Optional[int]]:
    """The interleaved order's groups worth trying for `plan` (see the module docstring)."""
    M, K = space.num_microbatches, space.num_stages
    fewest = virtual_group(plan, M, K)
    larger = next((g for g in range(fewest + 1, M) if allowed_group(g, M, K, plan.num_cells)), None)
    return list(dict.fromkeys(g for g in (fewest, larger, M) if g is not None))


class NoAllowedGroupError(ValueError):
    """A fixed microbatch group that no candidate slicing makes allowed (allowed_group)."""


def virtual_plans(space: SearchSpace, num_chunks: int, hint: Optional[TeraPipePlan] = None,
                  placement: str = "ring",
                  chunk_layers: tuple[int, ...] = ()) -> list[tuple[str, TeraPipePlan]]:
    """Step 1's plans, named; with the space's `microbatch_group` (1f1b), only that group, in
    the slicings it is allowed for (NoAllowedGroupError when none); in a V, each V_LEADS, on
    chunks of `chunk_layers` layers (empty: equal chunks)."""
    group = space.microbatch_group
    most = space.seq_length // space.unit
    counts = set(c for c in SLICE_COUNTS if c <= most)
    if hint is not None:
        n = len(hint.token_slices[0])
        counts |= {c for c in (n - 1, n, n + 1) if 1 <= c <= most}
    modes = (False, True) if space.defer_wgrad is None else (bool(space.defer_wgrad),)
    out = []
    for n in sorted(counts):
        base = TeraPipePlan.uniform(space.seq_length, n, space.order, space.unit)
        base = replace(base, virtual_stages=num_chunks, chunk_layers=chunk_layers)
        if placement == "v":
            leads = V_LEADS if space.order == "1f1b" else (None,)  # gpipe: all in flight
            out += [(f"uniform x{n} in a V" + (f", lead {lead}" if lead is not None else ""),
                     replace(base, virtual_placement="v", virtual_warmup=lead, defer_wgrad=mode))
                    for lead in leads for mode in modes]
            continue
        groups = group_options(space, base) if space.order == "1f1b" else [None]
        if group is not None and space.order == "1f1b":
            M, K = space.num_microbatches, space.num_stages
            groups = [group] if allowed_group(group, M, K, base.num_cells) else []
        for g in groups:
            for mode in modes:
                name = f"uniform x{n}" + (f", groups of {g}" if g is not None else "")
                out.append((name, replace(base, virtual_group=g, defer_wgrad=mode)))
    if not out:
        raise NoAllowedGroupError(
            f"no slicing the search tries (up to {max(counts)} slice{'s' * (max(counts) > 1)}) "
            f"gives every group of {group} of the "
            f"{space.num_microbatches} microbatches (and a shorter last one) a unit per pipeline "
            f"stage ({space.num_stages})")
    return out


def search_virtual(cost_model: CostModel, space: SearchSpace, budget: MemoryBudget,
                   num_chunks: int, hint: Optional[TeraPipePlan] = None,
                   placement: str = "ring",
                   chunk_layers: tuple[int, ...] = ()) -> VirtualSearchResult:
    """The fastest plan on `num_chunks` chunks per stage that fits `budget` (module
    docstring), in the space's `microbatch_group` when it fixes one (else the search
    chooses); `placement` "v": in a V (2 chunks, of `chunk_layers` layers where they differ:
    plan.v_chunk_layers). Raises MemoryBudgetError (with `leanest`)
    when none fits, NoAllowedGroupError when no slicing allows the group, ValueError when the
    pipeline has one stage or a V has other than 2 chunks."""
    if space.num_stages < 2:
        raise ValueError("virtual stages need at least 2 pipeline stages")
    if placement == "v" and num_chunks != 2:
        raise ValueError(f"a V holds 2 model chunks per rank, not {num_chunks}")
    shape = (space.num_microbatches, space.num_stages, space.micro_batch_size)
    caches = shared_caches(cost_model, space.memory)
    plans = virtual_plans(space, num_chunks, hint, placement, chunk_layers)
    floors = [compute_floor(cost_model, space, plan) for _, plan in plans]
    timed: list[tuple[float, int]] = []
    peaks: dict[int, float] = {}
    for i in sorted(range(len(plans)), key=lambda i: (floors[i], i)):
        if timed and floors[i] > min(timed)[0]:
            break  # this plan and every later one take longer than the fastest found
        for lead in (None, 1, 0) if space.order == "1f1b" and placement == "ring" else (None,):
            # a shorter warm-up keeps less alive: tried when Megatron's does not fit by less
            # than LEAD_REACH (it saves a few units' activations)
            if lead is not None and peaks[i] > budget.budget_bytes * LEAD_REACH:
                break
            plan = plans[i][1] if lead is None else replace(plans[i][1], virtual_warmup=lead)
            schedule = build_schedule(plan, *shape)
            found = estimate_lists(schedule, cost_model, space.memory, caches)
            peaks[i] = min(peaks.get(i, float("inf")), max(budget.totals(found.peak_memory_bytes)))
            if budget.fits(found.peak_memory_bytes):
                plans[i] = (plans[i][0] + ("" if lead is None else f", warm-up {lead}"), plan)
                # its busiest stage's compute bounds it, W places or not: timed if below
                if not timed or found.busiest_compute < min(timed)[0]:
                    timed.append((plan_time(plan, cost_model, *shape, cache=caches.costs), i))
                break
    if not timed:
        raise _no_fit(cost_model, space, budget, plans, peaks, num_chunks)
    timed.sort()
    best: Optional[tuple[float, TeraPipePlan, str]] = None
    for rank, (time, i) in enumerate(timed):
        name, plan = plans[i]
        if space.place_wgrad and rank < PLACED and plan.defer_wgrad:
            plan, time = plan_wgrad(plan, cost_model, *shape, budget, space.memory,
                                    cache=caches.costs, default_time=time)
        if best is None or time < best[0]:
            best = (time, plan, name)
    time, plan, name = best
    chosen = Candidate(name, replace(plan, predicted_time=time), space.simulate(plan, cost_model))
    return VirtualSearchResult(chosen, tuple((plans[i][0], t) for t, i in timed))


def _no_fit(cost_model: CostModel, space: SearchSpace, budget: MemoryBudget, plans: list,
            peaks: dict, num_chunks: int) -> MemoryBudgetError:
    """The error for no plan that fits, with the leanest plan (simulated) as `leanest`."""
    shape = (space.num_microbatches, space.num_stages, space.micro_batch_size)
    for i in range(len(plans)):  # the floor cut none short: every plan estimated
        if i not in peaks:
            found = estimate_lists(build_schedule(plans[i][1], *shape), cost_model,
                                   space.memory, shared_caches(cost_model, space.memory),
                                   with_times=False)
            peaks[i] = max(budget.totals(found.peak_memory_bytes))
    lean = min(peaks, key=lambda i: (peaks[i], i))
    leanest = Candidate(plans[lean][0], plans[lean][1], space.simulate(plans[lean][1], cost_model))
    error = MemoryBudgetError(
        f"no {space.order} plan on {num_chunks} chunks per stage fits the memory budget of "
        f"{format_size(budget.budget_bytes)} per GPU: the leanest ({leanest.label}) peaks at "
        f"{format_size(peaks[lean])}")
    error.leanest = leanest  # type: ignore[attr-defined]
    return error
