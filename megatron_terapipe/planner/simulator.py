"""Simulate a schedule under a cost model: iteration time, bubbles, peak memory per stage.

The simulator times exactly the per-stage action lists the executor runs (`schedule.timeline`):
each action takes the cost model's forward or backward time for its cell, plus, on the first
stage and on the last, the cost model's edge time (embedding; output layer and loss; both on a
one-stage pipeline), and a result reaches the neighbouring stage after the cell's transfer time
(sends overlap with compute).

Memory on a stage, walked in that stage's action order:
- a cell's activations are held from the start of its forward to the end of its backward
  (in a forward-only run, until the end of its forward);
- a cell's K/V are held from the start of its forward until the end of the backward of its
  sequence's first token slice (the executor keeps one K/V buffer per sequence and layer, and
  that backward is the last to read it). Forward-only: until the forward of the sequence's
  last token slice has run;
- a sequence's K/V gradient buffer (as large as its K/V) appears when the backward of its last
  slice starts and goes with its K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..plan import TeraPipePlan
from ..schedule import Action, Cell, Schedule, TimedAction, build_schedule, timeline
from .cost_model import CostModel


@dataclass(frozen=True)
class MemoryPoint:
    """Live bytes on one stage right after an allocation or a release."""

    time: float
    activation_bytes: float
    kv_bytes: float


@dataclass(frozen=True)
class SimulationResult:
    """What one iteration of a schedule costs under a cost model."""

    schedule: Schedule
    timeline: tuple[TimedAction, ...]
    iteration_time: float  # seconds from the first action's start to the last action's end
    busy: tuple[float, ...]  # seconds each stage computes
    peak_activation_bytes: tuple[float, ...]  # per stage
    peak_kv_bytes: tuple[float, ...]  # per stage, K/V and their gradients
    peak_memory_bytes: tuple[float, ...]  # per stage, peak of activations + K/V together
    memory: tuple[tuple[MemoryPoint, ...], ...] = field(repr=False)  # per stage, over time

    @property
    def num_stages(self) -> int:
        return len(self.busy)

    @property
    def idle(self) -> tuple[float, ...]:
        """Seconds each stage waits during the iteration."""
        return tuple(self.iteration_time - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Share of all stages' time spent waiting: 1 - busy / (stages x iteration time)."""
        if self.iteration_time <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_stages * self.iteration_time)

    def summary(self) -> str:
        gib = 1024 ** 3
        return (f"iteration {self.iteration_time * 1e3:.3f} ms, bubble "
                f"{100 * self.bubble_fraction:.1f}%, peak memory per stage "
                f"{min(self.peak_memory_bytes) / gib:.2f}-{max(self.peak_memory_bytes) / gib:.2f} GiB")


class _CellCosts:
    """Cost-model calls cached per cell shape (schedules repeat the same shapes a lot)."""

    def __init__(self, cost_model: CostModel, schedule: Schedule):
        self.cost_model = cost_model
        self.num_stages = schedule.num_stages
        self.defer_wgrad = schedule.defer_wgrad
        self.token_slices = schedule.plan.token_slices
        self._cache: dict[tuple, float] = {}
        # (stage, W cell) -> token slices whose weight gradients it computes: as the executor's
        # store, every slice of the sequence backwarded since the sequence's previous W.
        self._w_slices: dict[tuple[int, Cell], tuple[int, ...]] = {}
        if self.defer_wgrad:
            for k, actions in enumerate(schedule.stages):
                pending: dict[tuple[int, int], list[int]] = {}
                for a in actions:
                    if a.kind == "B":
                        pending.setdefault(a.cell.sequence_key, []).append(a.cell.token_slice)
                    elif a.kind == "W":
                        self._w_slices[(k, a.cell)] = tuple(pending.pop(a.cell.sequence_key, ()))

    def _get(self, key: tuple, fn, *args) -> float:
        value = self._cache.get(key)
        if value is None:
            value = float(fn(*args))
            if not value >= 0:
                raise ValueError(f"cost model {self.cost_model.describe()} returned {value} for "
                                 f"{key[0]}{key[1:]}; costs must be non-negative numbers")
            self._cache[key] = value
        return value

    def compute(self, stage: int, action: Action) -> float:
        c = action.cell
        m = self.cost_model
        first, last = stage == 0, stage == self.num_stages - 1
        if action.kind == "W":
            # The weight gradients its sequence deferred since its last W, as the executor
            # computes them: one gradient per weight over all those tokens (context plays no
            # part).
            shapes = self._sequence(c)
            tokens = sum(shapes[t][0] for t in self._w_slices.get((stage, c), ()))
            return self._wgrad(c.rows, tokens, 0, first, last) if tokens else 0.0
        if action.kind == "F":
            layers = self._get(("F", c.rows, c.tokens, c.context), m.forward_time,
                               c.rows, c.tokens, c.context)
        else:
            layers = self._get(("B", c.rows, c.tokens, c.context), m.backward_time,
                               c.rows, c.tokens, c.context)
        if first or last:
            edge_fn = m.edge_forward_time if action.kind == "F" else m.edge_backward_time
            layers += self._get(("E" + action.kind, c.rows, c.tokens, first, last), edge_fn,
                                c.rows, c.tokens, first, last)
        if action.kind == "B" and self.defer_wgrad:
            saving = self._get(("WS", c.rows, c.tokens, c.context, first, last),
                               self.cost_model.deferred_backward_saving, c.rows, c.tokens,
                               c.context, first, last)
            layers = max(0.0, layers - saving)
        return layers

    def _wgrad(self, rows: int, tokens: int, context: int, first: bool, last: bool) -> float:
        return self._get(("WG", rows, tokens, context, first, last), self.cost_model.wgrad_time,
                         rows, tokens, context, first, last)

    def _sequence(self, cell: Cell) -> list[tuple[int, int]]:
        """(tokens, context) of every token slice of the cell's batch slice."""
        out, start = [], 0
        for t in self.token_slices[cell.batch_slice]:
            out.append((t, start))
            start += t
        return out

    def transfer(self, stage: int, action: Action) -> float:
        c = action.cell
        return self._get(("X", c.rows, c.tokens), self.cost_model.transfer_time, c.rows, c.tokens)

    def activation(self, action: Action) -> float:
        c = action.cell
        return self._get(("A", c.rows, c.tokens, c.context), self.cost_model.activation_bytes,
                         c.rows, c.tokens, c.context)

    def wgrad_hold(self, action: Action) -> float:
        c = action.cell
        return self._get(("WH", c.rows, c.tokens), self.cost_model.wgrad_hold_bytes, c.rows, c.tokens)

    def kv(self, action: Action) -> float:
        c = action.cell
        return self._get(("KV", c.rows, c.tokens), self.cost_model.kv_bytes, c.rows, c.tokens)


def simulate_plan(plan: TeraPipePlan, cost_model: CostModel, num_microbatches: int,
                  num_stages: int, micro_batch_size: int,
                  cores: Optional[float] = None) -> SimulationResult:
    """`simulate` of `plan`'s schedule for one run's shape."""
    schedule = build_schedule(plan, num_microbatches, num_stages, micro_batch_size)
    return simulate(schedule, cost_model, cores=cores)


def plan_time(plan: TeraPipePlan, cost_model: CostModel, num_microbatches: int,
              num_stages: int, micro_batch_size: int, cores: Optional[float] = None) -> float:
    """Simulated iteration time of `plan`'s schedule (the planner's yardstick)."""
    return simulate_plan(plan, cost_model, num_microbatches, num_stages, micro_batch_size,
                         cores).iteration_time


def simulate(schedule: Schedule, cost_model: CostModel,
             timed: Optional[list[TimedAction]] = None,
             cores: Optional[float] = None) -> SimulationResult:
    """Time `schedule` under `cost_model` and track memory per stage.

    `timed` may pass a timeline already computed for this schedule and cost model. `cores`:
    the stages share this many processors (e.g. a CPU run whose processes share cores); None
    means every stage has its own device.
    """
    costs = _CellCosts(cost_model, schedule)
    if timed is None and cores is not None and cores < schedule.num_stages:
        from ..schedule import shared_timeline

        timed = shared_timeline(schedule, costs.compute, costs.transfer, cores)
    if timed is None:
        timed = timeline(schedule, costs.compute, costs.transfer)
    K = schedule.num_stages
    per_stage: list[list[TimedAction]] = [[] for _ in range(K)]
    for ta in timed:
        per_stage[ta.stage].append(ta)
    if timed:
        start = min(ta.start for ta in timed)
        iteration = max(ta.end for ta in timed) - start
    else:
        iteration = 0.0
    busy = []
    peaks_act, peaks_kv, peaks_total, memory = [], [], [], []
    for k in range(K):
        actions = per_stage[k]  # already in the stage's own order
        busy.append(sum(ta.end - ta.start for ta in actions))
        points, peak_a, peak_kv, peak_t = _stage_memory(actions, costs, schedule.forward_only)
        peaks_act.append(peak_a)
        peaks_kv.append(peak_kv)
        peaks_total.append(peak_t)
        memory.append(tuple(points))
    return SimulationResult(schedule=schedule, timeline=tuple(timed), iteration_time=iteration,
                            busy=tuple(busy), peak_activation_bytes=tuple(peaks_act),
                            peak_kv_bytes=tuple(peaks_kv), peak_memory_bytes=tuple(peaks_total),
                            memory=tuple(memory))


def _stage_memory(actions: list[TimedAction], costs: _CellCosts, forward_only: bool):
    """Walk one stage's actions in order; return memory points and the three peaks."""
    act = kv = 0.0
    peak_a = peak_kv = peak_t = 0.0
    points: list[MemoryPoint] = []
    # keys are (microbatch, batch slice, token slice): cheaper to hash than Cell
    kv_of: dict[tuple[int, int, int], float] = {}  # K/V bytes of cells whose K/V are live
    grads_of: dict[tuple[int, int], float] = {}  # sequence -> K/V gradient buffer bytes
    slices_seen: dict[tuple[int, int], list[int]] = {}  # sequence -> token slices run forward

    def record(time: float) -> None:
        nonlocal peak_a, peak_kv, peak_t
        peak_a, peak_kv, peak_t = max(peak_a, act), max(peak_kv, kv), max(peak_t, act + kv)
        points.append(MemoryPoint(time, act, kv))

    held: dict[tuple[int, int], float] = {}  # sequence -> bytes kept for its W action

    for ta in actions:
        a, c = ta.action, ta.action.cell
        seq = (c.microbatch, c.batch_slice)
        key = (c.microbatch, c.batch_slice, c.token_slice)
        if a.kind == "W":
            act -= held.pop(seq, 0.0)
            record(ta.end)
            continue
        if a.kind == "F":
            act += costs.activation(a)
            kv_of[key] = costs.kv(a)
            kv += kv_of[key]
            slices_seen.setdefault(seq, []).append(c.token_slice)
            record(ta.start)
            if forward_only:
                act -= costs.activation(a)
                if c.is_last_token_slice:
                    kv -= sum(kv_of.pop(seq + (t,), 0.0) for t in slices_seen.pop(seq, []))
                record(ta.end)
        else:
            if c.is_last_token_slice:
                # The sequence's first backward allocates its K/V gradient buffer (whole sequence).
                grads_of[seq] = sum(kv_of.get(seq + (t,), 0.0) for t in slices_seen.get(seq, []))
                kv += grads_of[seq]
                record(ta.start)
            act -= costs.activation(a)
            if costs.defer_wgrad:  # linear inputs and output gradients wait for the W action
                hold = costs.wgrad_hold(a)
                act += hold
                held[seq] = held.get(seq, 0.0) + hold
            if c.token_slice == 0:
                # The executor keeps one K/V buffer per sequence and layer; it goes with the
                # backward of the sequence's first slice, the last one that reads it.
                kv -= sum(kv_of.pop(seq + (t,), 0.0) for t in slices_seen.pop(seq, []))
                kv -= grads_of.pop(seq, 0.0)
            record(ta.end)
    return points, peak_a, peak_kv, peak_t
