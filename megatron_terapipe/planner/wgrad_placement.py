"""W placement: where each stage runs its W actions, planned by list scheduling.

A W action computes weight gradients nothing waits for before the optimizer step, so it may
run anywhere after the backward whose gradients it holds. The schedule's default puts it right
after its sequence's last backward (on its chunk), where it can delay the next forward or
backward that a neighbour waits for. `place_wgrad` replays a schedule's F/B lists under a cost
model as the timing engines do (an action starts when the stage is free and its message has
arrived) and, at each point where the stage's next F or B is not ready, runs the oldest W it
may run instead (a `WgradPolicy` says when a W is worth starting there); the W actions left
run after the stage's last F/B. W actions keep their order. A deferred W holds its inputs and
output gradients until it runs, so within a memory budget, before each F or B whose peak
(memory_walk.py, the walk the simulator does) would pass the stage's limit, W actions run
first: with none pending the stage holds what the default places hold, so the peak never
passes the larger of the limit and the default's peak.

The result is data on the plan (`TeraPipePlan.wgrad_after`: per stage, how many F/B actions
run before each W); the builder lays the W actions out there, the executor runs that list and
the simulator times it: the time `place_wgrad` computed, to the bit (tests/test_wgrad_placement.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ..plan import TeraPipePlan
from ..schedule import Action, Schedule, TimedAction, build_schedule
from ..schedule.actions import peer_cell
from ..schedule.lower import message_ends
from ..schedule.wgrad_places import default_places
from .cost.cost_model import CostModel
from .cost.stage_memory import CostModelMemory, MemoryBudget, StageMemory
from .memory_walk import MemoryWalk
from .simulator import CellCosts, plan_time


@dataclass(frozen=True)
class WgradPolicy:
    """When a stage whose next F/B is not ready starts a W instead.

    patience: start it when it takes at most this share of the known wait for the input;
    None: whenever the input is not there. unknown: while the input's sender has not started
    its action, judge by the least possible wait (the sender's whole action and transfer
    from now); False: wait for the input then."""

    name: str
    patience: Optional[float] = 1.0
    unknown: bool = False


#: The policies `plan_wgrad` tries (the fastest wins; the default places when none is faster).
POLICIES = (WgradPolicy("fill", None, True), WgradPolicy("fit", 1.0, True),
            WgradPolicy("fit-known", 1.0, False))
_EPS = 1e-12


@dataclass
class _Stage:
    """One stage's lists and where its replay is."""

    ops: list  # F and B actions, in order
    weight_grads: list  # W actions, in their default order
    earliest: list  # per W: F/B actions before its default place
    inputs: list  # per op: the arrival key of its message, or None
    outputs: list  # per op: the arrival key its result goes to, or None
    walk: Optional[MemoryWalk]
    limit: Optional[float]
    pos: int = 0
    next_w: int = 0
    time: float = 0.0
    places: list = None  # type: ignore[assignment]
    deferred_tokens: dict = None  # type: ignore[assignment]

    def w_ready(self) -> bool:
        return self.next_w < len(self.weight_grads) and self.earliest[self.next_w] <= self.pos


class _Placer:
    def __init__(self, schedule: Schedule, costs: CellCosts, policy: WgradPolicy,
                 limits: Optional[Sequence[Optional[float]]], memory: Optional[StageMemory]):
        self.schedule, self.costs, self.policy = schedule, costs, policy
        K = schedule.num_stages
        cells: dict = {}
        self.producer: dict = {}  # arrival key -> (stage, op) of its sender
        self.stages = [self._stage(k, cells, limits, memory) for k in range(K)]
        self.arrival: dict = {}
        self.waiting: dict = {}
        self.heap = [(0.0, k) for k in range(K)]

    def _stage(self, k: int, cells: dict, limits, memory) -> _Stage:
        schedule, K = self.schedule, self.schedule.num_stages
        actions = schedule.stages[k]
        receives, sends = message_ends(schedule, k)
        ops = [a for a in actions if a.kind != "W"]

        def key(stage: int, direction: str, cell) -> tuple:
            return stage, direction, cells.setdefault(cell, len(cells))

        inputs = [key(k, a.kind, a.cell) if receives(a) else None for a in ops]
        outputs = []
        for a in ops:
            if not sends(a):
                outputs.append(None)
                continue
            to = (k + 1 if a.kind == "F" else k - 1) % K
            out = key(to, a.kind, peer_cell(a.cell, a.kind, k, K))
            outputs.append(out)
            self.producer[out] = (k, a)
        limit = None if limits is None else limits[k]
        walk = MemoryWalk(memory, schedule, k, False) if limit is not None else None
        return _Stage(ops, [a for a in actions if a.kind == "W"], default_places(actions),
                      inputs, outputs, walk, limit, places=[], deferred_tokens={})

    def run(self) -> tuple[tuple[int, ...], ...]:
        while self.heap:
            t, k = heapq.heappop(self.heap)
            st = self.stages[k]
            st.time = max(st.time, t)
            wake = self._step(k, st)
            if wake is not None:
                heapq.heappush(self.heap, (wake, k))
        for k, st in enumerate(self.stages):
            if st.pos < len(st.ops) or st.next_w < len(st.weight_grads):
                raise ValueError(f"W placement: stage {k} stopped at action {st.pos}: the "
                                 "schedule deadlocks (validate it first)")
        return tuple(tuple(st.places) for st in self.stages)

    def _step(self, k: int, st: _Stage) -> Optional[float]:
        """Run the stage's next action if it may; returns when to look again (None: when a
        message it waits for is sent, or never: done)."""
        if st.pos == len(st.ops):
            if st.next_w == len(st.weight_grads):
                return None
            self._run_w(k, st)
            return st.time
        op, key = st.ops[st.pos], st.inputs[st.pos]
        arrival = 0.0 if key is None else self.arrival.get(key)
        if st.w_ready() and st.walk is not None and \
                st.walk.peak_with(TimedAction(k, op, 0.0, 0.0)) > st.limit:
            self._run_w(k, st)  # the budget: what waits for W goes before this F/B
            return st.time
        if arrival is not None and arrival <= st.time + _EPS:
            self._run_op(k, st, op)
            return st.time
        if st.w_ready() and self._worth_a_w(k, st, arrival, key):
            self._run_w(k, st)
            return st.time
        if arrival is not None:
            return arrival
        self.waiting[key] = k
        return None

    def _worth_a_w(self, k: int, st: _Stage, arrival: Optional[float], key) -> bool:
        policy = self.policy
        if policy.patience is None:
            return True
        if arrival is None:  # its sender has not started: it arrives after its whole action
            sender, action = self.producer[key]
            arrival = (max(self.stages[sender].time, st.time) + self.costs.compute(sender, action)
                       + self.costs.transfer(sender, action))
            if policy.unknown and self._w_time(k, st) <= policy.patience * (arrival - st.time):
                return True
            return False
        return self._w_time(k, st) <= policy.patience * (arrival - st.time)

    def _w_time(self, k: int, st: _Stage) -> float:
        w = st.weight_grads[st.next_w]
        return self.costs.w_time(k, w.cell, st.deferred_tokens.get(w.cell.sequence_key, 0))

    def _run_w(self, k: int, st: _Stage) -> None:
        w = st.weight_grads[st.next_w]
        end = st.time + self._w_time(k, st)
        st.deferred_tokens.pop(w.cell.sequence_key, None)
        if st.walk is not None:
            st.walk.terapipe(TimedAction(k, w, st.time, end))
        st.places.append(st.pos)
        st.next_w += 1
        st.time = end

    def _run_op(self, k: int, st: _Stage, op: Action) -> None:
        end = st.time + self.costs.compute(k, op)
        if st.walk is not None:
            st.walk.terapipe(TimedAction(k, op, st.time, end))
        if op.kind == "B":
            seq = op.cell.sequence_key
            st.deferred_tokens[seq] = st.deferred_tokens.get(seq, 0) + op.cell.tokens
        out = st.outputs[st.pos]
        if out is not None:
            arrival = self.arrival[out] = end + self.costs.transfer(k, op)
            waiting = self.waiting.pop(out, None)
            if waiting is not None:
                heapq.heappush(self.heap, (max(arrival, self.stages[waiting].time), waiting))
        st.pos += 1
        st.time = end


def place_wgrad(schedule: Schedule, cost_model: CostModel, policy: WgradPolicy = POLICIES[0],
                limits: Optional[Sequence[Optional[float]]] = None,
                memory: Optional[StageMemory] = None,
                cache: Optional[dict] = None) -> tuple[tuple[int, ...], ...]:
    """Per stage, how many F/B actions run before each of its W actions (the plan's
    `wgrad_after`), by list scheduling under `cost_model` with `policy`. `limits`: per stage,
    the bytes of activations and K/V it may keep (None: no limit), walked with `memory`
    (default: the cost model's). The schedule must defer weight gradients, forwards and
    backwards included, without early W actions placed off their defaults."""
    if not schedule.defer_wgrad:
        raise ValueError("W placement needs a plan that defers weight gradients (defer_wgrad)")
    memory = memory if memory is not None else CostModelMemory(cost_model)
    costs = CellCosts(cost_model, schedule, cache)
    return _Placer(schedule, costs, policy, limits, memory).run()


def stage_limits(budget: Optional[MemoryBudget], num_stages: int) -> Optional[list[float]]:
    """Per stage, the bytes of activations and K/V the budget leaves beside the model state."""
    if budget is None or budget.budget_bytes is None:
        return None
    return [budget.budget_bytes - budget.state(k) for k in range(num_stages)]


def plan_wgrad(plan: TeraPipePlan, cost_model: CostModel, num_microbatches: int,
               num_stages: int, micro_batch_size: int,
               budget: Optional[MemoryBudget] = None, memory: Optional[StageMemory] = None,
               policies: Sequence[WgradPolicy] = POLICIES,
               cache: Optional[dict] = None) -> tuple[TeraPipePlan, float]:
    """`plan` with its W actions placed by the fastest of `policies` (`place_wgrad`), and its
    simulated time; `plan` itself (default places) when no placement is faster. Never slower
    than the default places, and within the budget wherever they are."""
    plain = replace(plan, wgrad_after=())
    best_time = plan_time(plain, cost_model, num_microbatches, num_stages, micro_batch_size,
                          cache=cache)
    if not plan.defer_wgrad:
        return plain, best_time
    schedule = build_schedule(plain, num_microbatches, num_stages, micro_batch_size)
    limits = stage_limits(budget, num_stages)
    defaults = tuple(tuple(default_places(actions)) for actions in schedule.stages)
    best = plain
    for policy in policies:
        places = place_wgrad(schedule, cost_model, policy, limits, memory, cache)
        if places == defaults:
            continue
        placed = replace(plain, wgrad_after=places)
        time = plan_time(placed, cost_model, num_microbatches, num_stages, micro_batch_size,
                         cache=cache)
        if time < best_time:
            best, best_time = placed, time
    return replace(best, predicted_time=best_time), best_time
