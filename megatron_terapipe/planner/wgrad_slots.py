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
(evaluate/memory_walk.py, the walk the simulator does) would pass the stage's limit, W actions run
first: with none pending the stage holds what the default places hold, so the peak never
passes the larger of the limit and the default's peak.

The result is data on the plan (`TeraPipePlan.wgrad_after`: per stage, how many F/B actions
run before each W); the builder lays the W actions out there, the executor runs that list and
the simulator times it: the time `place_wgrad` computed, to the bit (tests/planner/test_wgrad_placement.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from ..plan import TeraPipePlan
from ..schedule import Action, Schedule, TimedAction, build_schedule
from ..schedule.actions import peer_cell
from ..schedule.routes import message_peer
from ..schedule.lower import message_ends
from ..schedule.build import default_places
from .cost.cost_model import CostModel
from .cost.recompute_memory import memory_of
from .cost.stage_memory import MemoryBudget, StageMemory
from .evaluate.memory_walk import MemoryWalk
from .evaluate.simulator import CellCosts, plan_time


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
#: ("fit" without `unknown` was never the fastest on terapipe-plan's GPT-3 cases: left out.)
POLICIES = (WgradPolicy("fill", None, True), WgradPolicy("fit", 1.0, True))
_EPS = 1e-12


@dataclass
class _StageLists:
    """One stage's lists, as every policy's replay reads them."""

    ops: list  # F and B actions, in order
    weight_grads: list  # W actions, in their default order
    earliest: list  # per W: F/B actions before its default place
    inputs: list  # per op: the arrival key of its message, or None
    outputs: list  # per op: the arrival key its result goes to, or None
    seconds: list  # per op: its compute time
    transfers: list  # per op: its message's transfer time (0 without one)


def _stage_lists(schedule: Schedule, k: int, costs: CellCosts, keys: dict,
                 producer: dict) -> _StageLists:
    """Stage k's lists; `keys`: id(cell) -> a number shared by equal cells (peer cells of the
    ring of virtual stages are made anew: looked up by value in keys["value"])."""
    K = schedule.num_stages
    actions = schedule.stages[k]
    receives, sends = message_ends(schedule, k)
    ops = [a for a in actions if a.kind != "W"]
    by_value = keys["value"]

    def key(stage: int, direction: str, cell, own: bool = True) -> tuple:
        # the schedule's own cells live as long as it does: their ids can stand for them
        number = keys.get(id(cell)) if own else None
        if number is None:
            number = by_value.setdefault(cell, len(by_value))
            if own:
                keys[id(cell)] = number
        return stage, direction, number

    inputs = [key(k, a.kind, a.cell) if receives(a) else None for a in ops]
    outputs = []
    for a in ops:
        if not sends(a):
            outputs.append(None)
            continue
        peer = peer_cell(a.cell, a.kind, k, K)
        out = key(message_peer(a.cell, a.kind, k, K), a.kind, peer, peer is a.cell)
        outputs.append(out)
        producer[out] = (k, a)
    seconds = [costs.compute(k, a) for a in ops]
    transfers = [costs.transfer(k, a) if out is not None else 0.0 for a, out in zip(ops, outputs)]
    return _StageLists(ops, [a for a in actions if a.kind == "W"], default_places(actions),
                       inputs, outputs, seconds, transfers)


@dataclass
class _Stage:
    """Where one stage's replay is."""

    lists: _StageLists
    walk: Optional[MemoryWalk]
    limit: Optional[float]
    rise: float  # at least what any one F/B adds to the live bytes (skips most checks)
    pos: int = 0
    next_w: int = 0
    time: float = 0.0
    places: list = field(default_factory=list)
    deferred_tokens: dict = field(default_factory=dict)

    def w_ready(self) -> bool:
        return (self.next_w < len(self.lists.weight_grads)
                and self.lists.earliest[self.next_w] <= self.pos)


def _most_added(walk: MemoryWalk, ops: list) -> float:
    """At least what any one of `ops` adds to the stage's live bytes when it runs."""
    return max((sum(walk.cell_value(what, a.cell)
                    for what in ("cell", "kv", "kv_grad", "hold", "rise"))
                for a in {id(a.cell): a for a in ops}.values()), default=0.0)


class _Placer:
    def __init__(self, placer: "WgradPlacer", policy: WgradPolicy,
                 limits: Optional[Sequence[Optional[float]]]):
        self.schedule, self.costs, self.policy = placer.schedule, placer.costs, policy
        self.producer = placer.producer
        self.stages = []
        for k, lists in enumerate(placer.lists):
            limit = None if limits is None else limits[k]
            walk = None if limit is None else MemoryWalk(placer.memory, self.schedule, k, False,
                                                         placer.memory_cache)
            self.stages.append(_Stage(lists, walk, limit, placer.most_added(k, walk)))
        self.arrival: dict = {}
        self.waiting: dict = {}
        self.heap = [(0.0, k) for k in range(self.schedule.num_stages)]

    def run(self) -> tuple[tuple[tuple[int, ...], ...], float]:
        """(per stage, the F/B actions before each W; the iteration's end)."""
        while self.heap:
            t, k = heapq.heappop(self.heap)
            st = self.stages[k]
            st.time = max(st.time, t)
            wake = self._step(k, st)
            if wake is not None:
                heapq.heappush(self.heap, (wake, k))
        for k, st in enumerate(self.stages):
            if st.pos < len(st.lists.ops) or st.next_w < len(st.lists.weight_grads):
                raise ValueError(f"W placement: stage {k} stopped at action {st.pos}: the "
                                 "schedule deadlocks (validate it first)")
        return (tuple(tuple(st.places) for st in self.stages),
                max((st.time for st in self.stages), default=0.0))

    def _step(self, k: int, st: _Stage) -> Optional[float]:
        """Run the stage's next action if it may; returns when to look again (None: when a
        message it waits for is sent, or never: done)."""
        lists = st.lists
        if st.pos == len(lists.ops):
            if st.next_w == len(lists.weight_grads):
                return None
            self._run_w(k, st)
            return st.time
        op, key = lists.ops[st.pos], lists.inputs[st.pos]
        arrival = 0.0 if key is None else self.arrival.get(key)
        if st.w_ready() and st.walk is not None and \
                st.walk.act + st.walk.kv + st.rise > st.limit and \
                st.walk.peak_with(TimedAction(k, op, 0.0, 0.0)) > st.limit:
            self._run_w(k, st)  # the budget: what waits for W goes before this F/B
            return st.time
        if arrival is not None and arrival <= st.time + _EPS:
            st.time = max(st.time, arrival)  # as the timing engines: from when both are ready
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
            if not policy.unknown:
                return False
            sender, action = self.producer[key]
            arrival = (max(self.stages[sender].time, st.time) + self.costs.compute(sender, action)
                       + self.costs.transfer(sender, action))
        return self._w_time(k, st) <= policy.patience * (arrival - st.time)

    def _w_time(self, k: int, st: _Stage) -> float:
        w = st.lists.weight_grads[st.next_w]
        return self.costs.w_time(k, w.cell, st.deferred_tokens.get(w.cell.sequence_key, 0))

    def _run_w(self, k: int, st: _Stage) -> None:
        w = st.lists.weight_grads[st.next_w]
        end = st.time + self._w_time(k, st)
        st.deferred_tokens.pop(w.cell.sequence_key, None)
        if st.walk is not None:
            st.walk.terapipe(TimedAction(k, w, st.time, end))
        st.places.append(st.pos)
        st.next_w += 1
        st.time = end

    def _run_op(self, k: int, st: _Stage, op: Action) -> None:
        lists, i = st.lists, st.pos
        end = st.time + lists.seconds[i]
        if st.walk is not None:
            st.walk.terapipe(TimedAction(k, op, st.time, end))
        if op.kind == "B":
            seq = op.cell.sequence_key
            st.deferred_tokens[seq] = st.deferred_tokens.get(seq, 0) + op.cell.tokens
        out = lists.outputs[i]
        if out is not None:
            arrival = self.arrival[out] = end + lists.transfers[i]
            waiting = self.waiting.pop(out, None)
            if waiting is not None:
                heapq.heappush(self.heap, (max(arrival, self.stages[waiting].time), waiting))
        st.pos += 1
        st.time = end


class WgradPlacer:
    """A schedule's lists read once, placed by any policy (`place`)."""

    def __init__(self, schedule: Schedule, cost_model: CostModel,
                 memory: Optional[StageMemory] = None, cache: Optional[dict] = None):
        if not schedule.defer_wgrad:
            raise ValueError("W placement needs a plan that defers weight gradients "
                             "(defer_wgrad=True)")
        self.schedule = schedule
        self.memory = memory_of(cost_model, memory)
        self.costs = CellCosts(cost_model, schedule, cache)
        keys: dict = {"value": {}}
        self.producer: dict = {}  # arrival key -> (stage, op) of its sender
        self.lists = [_stage_lists(schedule, k, self.costs, keys, self.producer)
                      for k in range(schedule.num_stages)]
        self.memory_cache: dict = {}  # the StageMemory's answers, for every walk
        self._most_added: dict[int, float] = {}

    def most_added(self, k: int, walk: Optional[MemoryWalk]) -> float:
        """`_most_added` of stage k's F/B actions, once (0 without a walk)."""
        if walk is None:
            return 0.0
        if k not in self._most_added:
            self._most_added[k] = _most_added(walk, self.lists[k].ops)
        return self._most_added[k]

    def defaults(self) -> tuple[tuple[int, ...], ...]:
        """The default places, in `wgrad_after`'s form."""
        return tuple(tuple(stage.earliest) for stage in self.lists)

    def place(self, policy: WgradPolicy = POLICIES[0],
              limits: Optional[Sequence[Optional[float]]] = None
              ) -> tuple[tuple[tuple[int, ...], ...], float]:
        """Per stage, how many F/B actions run before each of its W actions (the plan's
        `wgrad_after`) by list scheduling with `policy`, and the simulated iteration time with
        those places. `limits`: per stage, the bytes of activations and K/V it may keep
        (None: no limit)."""
        return _Placer(self, policy, limits).run()


def place_wgrad(schedule: Schedule, cost_model: CostModel, policy: WgradPolicy = POLICIES[0],
                limits: Optional[Sequence[Optional[float]]] = None,
                memory: Optional[StageMemory] = None,
                cache: Optional[dict] = None) -> tuple[tuple[tuple[int, ...], ...], float]:
    """`WgradPlacer(schedule, cost_model, memory, cache).place(policy, limits)`: the places
    and the simulated iteration time with them. `memory` defaults to the cost model's."""
    return WgradPlacer(schedule, cost_model, memory, cache).place(policy, limits)


def stage_limits(budget: Optional[MemoryBudget], num_stages: int) -> Optional[list[float]]:
    """Per stage, the bytes of activations and K/V the budget leaves beside the model state."""
    if budget is None or budget.budget_bytes is None:
        return None
    return [budget.budget_bytes - budget.state(k) for k in range(num_stages)]


def plan_wgrad(plan: TeraPipePlan, cost_model: CostModel, num_microbatches: int,
               num_stages: int, micro_batch_size: int,
               budget: Optional[MemoryBudget] = None, memory: Optional[StageMemory] = None,
               policies: Sequence[WgradPolicy] = POLICIES, cache: Optional[dict] = None,
               default_time: Optional[float] = None) -> tuple[TeraPipePlan, float]:
    """`plan` with its W actions placed by the fastest of `policies` (`place_wgrad`), and its
    simulated time; `plan` itself (default places) when no placement is faster. Never slower
    than the default places, and within the budget wherever they are. `default_time`: the
    default places' simulated time, when known."""
    plain = replace(plan, wgrad_after=())
    best_time = default_time if default_time is not None else plan_time(
        plain, cost_model, num_microbatches, num_stages, micro_batch_size, cache=cache)
    if not plan.defer_wgrad:
        return plain, best_time
    placer = WgradPlacer(build_schedule(plain, num_microbatches, num_stages, micro_batch_size),
                         cost_model, memory, cache)
    limits = stage_limits(budget, num_stages)
    defaults = placer.defaults()
    best = plain
    for policy in policies:
        places, time = placer.place(policy, limits)
        if places != defaults and time < best_time:
            best, best_time = replace(plain, wgrad_after=places), time
    return replace(best, predicted_time=best_time), best_time
