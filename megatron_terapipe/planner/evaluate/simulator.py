"""Simulate a schedule under a cost model: iteration time, bubbles, peak memory per stage.

The simulator times exactly the per-stage action lists the executor runs (`schedule.timeline`):
each action takes the cost model's forward or backward time for its cell, plus, on the first
stage and on the last, the cost model's edge time (embedding; output layer and loss; both on a
one-stage pipeline), and a result reaches the neighbouring stage after the cell's transfer time
(sends overlap with compute).

Memory on a stage: its actions walked in order with a StageMemory (memory_walk.py): a cell's
activations from its forward to its backward, a sequence's K/V buffers (the whole sequence)
from its first slice's forward to that slice's backward, their gradients from the sequence's
first backward, what deferred weight gradients keep until the W action; Megatron's schedules
(`megatron=True`, the interleaved schedule) keep a whole microbatch from forward to backward.
The default StageMemory is the cost model's (`CostModelMemory`, with its recomputation:
`memory_of`); a measured one
(`FittedMemory`) predicts the runtime's bytes.

Megatron's interleaved schedule (schedule/interleaved.py) runs ChunkCells: each takes its
model chunk's share of the stage's layer time, and the edges only on the first chunk of the
first stage (embedding) and the last chunk of the last stage (output layer and loss).
TeraPipe's virtual stages (VirtualCell) likewise: a cell on one of V chunks takes 1/V of the
stage's layer time for its tokens and context, the edges only on the model's first and last
virtual stage, and a W action 1/V of the layers' weight gradients (plus the output layer's on
the last virtual stage).

Host floor (`host_floor`, off by default): an eager compute action costs at least the host
time of launching its kernels, however short its device work (`HostFloor`; a chunk's cell its
share). Per-action seconds: a cost model may say that `per_action_s` of each forward and
backward it prices is per compute action, not per layer (CalibratedCostModel's overhead,
evaluate/calibration.py); a chunk's cell then pays it whole, not its share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ...plan import TeraPipePlan
from ...schedule import (Action, Cell, ChunkCell, Schedule, TimedAction, VirtualCell,
                        build_schedule, timeline)
from ...schedule.actions import first_virtual_stage, last_virtual_stage
from ..cost.cost_model import CostModel
from ..cost.recompute_memory import memory_of
from ..cost.stage_memory import StageMemory
from .memory_walk import MemoryPoint, walk_stage

__all__ = ["HostFloor", "MemoryPoint", "SimulationResult", "plan_time", "schedule_time",
           "simulate", "simulate_plan"]


@dataclass(frozen=True)
class HostFloor:
    """Seconds the host takes to launch one compute action's kernels over a whole stage's
    layers, per kind: an eager action lasts at least this long, since its device work cannot
    run ahead of its launches. A model chunk's cell (virtual stages, Megatron's interleaved
    chunks) launches its share of the layers, so its floor is that share."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    wgrad_s: float = 0.0

    def seconds(self, kind: str, share: float = 1.0) -> float:
        return share * {"F": self.forward_s, "B": self.backward_s, "W": self.wgrad_s}[kind]


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
    def bubble_fraction(self) -> float:
        """Share of all stages' time spent waiting: 1 - busy / (stages x iteration time)."""
        if self.iteration_time <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_stages * self.iteration_time)

    def summary(self) -> str:
        """Iteration time, bubble, and each stage's peak of activations + K/V."""
        gib = 1024 ** 3
        peaks = " ".join(f"{p / gib:.2f}" for p in self.peak_memory_bytes[:12])
        more = " ..." if self.num_stages > 12 else ""
        return (f"iteration {self.iteration_time * 1e3:.3f} ms, bubble "
                f"{100 * self.bubble_fraction:.1f}%, peak memory per stage (GiB) {peaks}{more}")


class CellCosts:
    """Cost-model calls cached per cell shape (schedules repeat the same shapes a lot)."""

    def __init__(self, cost_model: CostModel, schedule: Schedule, cache: Optional[dict] = None,
                 host_floor: Optional[HostFloor] = None):
        """`cache`: the cost model's answers to share with other schedules (its keys hold
        everything an answer depends on). `host_floor`: every action lasts at least its
        launches' host time (None: no floor)."""
        self.cost_model = cost_model
        self.host_floor = host_floor
        # seconds of each F and B the cost model prices per action, not per layer
        self.per_action = float(getattr(cost_model, "per_action_s", 0.0))
        self.schedule = schedule
        self.num_stages = schedule.num_stages
        self.defer_wgrad = schedule.defer_wgrad
        self.token_slices = schedule.plan.token_slices
        self._cache: dict[tuple, float] = {} if cache is None else cache
        self._w_slices: Optional[dict[tuple[int, Cell], tuple[int, ...]]] = None
        # (first stage, last stage, kind, id(cell)) -> seconds: the stages between the first
        # and the last time their cells alike; ids hold while the schedule lives, as this does
        self._by_cell: dict[tuple, float] = {}
        self._sequences: dict[tuple, list[tuple[int, int]]] = {}

    def w_slices(self) -> dict[tuple[int, Cell], tuple[int, ...]]:
        """(stage, W cell) -> token slices whose weight gradients it computes: as the
        executor's store, every slice of the sequence backwarded since its previous W."""
        if self._w_slices is None:
            self._w_slices = {}
            for k, actions in enumerate(self.schedule.stages):
                pending: dict[tuple[int, int], list[int]] = {}
                for a in actions:
                    if a.kind == "B":
                        pending.setdefault(a.cell.sequence_key, []).append(a.cell.token_slice)
                    elif a.kind == "W":
                        self._w_slices[(k, a.cell)] = tuple(pending.pop(a.cell.sequence_key, ()))
        return self._w_slices

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
        if action.kind == "W":
            return self._compute(stage, action)
        key = (stage == 0, stage == self.num_stages - 1, action.kind, id(action.cell))
        value = self._by_cell.get(key)
        if value is None:
            value = self._compute(stage, action)
            if self.host_floor is not None:
                value = max(value, self.host_floor.seconds(action.kind, _share(action.cell)))
            self._by_cell[key] = value
        return value

    def _compute(self, stage: int, action: Action) -> float:
        c = action.cell
        if isinstance(c, ChunkCell):
            return self._chunk(stage, action)
        m = self.cost_model
        # a virtual stage's chunk runs 1/V of the stage's layers (`share`); the edges run
        # where the model's first and last layers do
        share = c.share if type(c) is VirtualCell else 1.0
        first = first_virtual_stage(c, stage)
        last = last_virtual_stage(c, stage, self.num_stages)
        if action.kind == "W":
            # The weight gradients its sequence deferred since its last W, as the executor
            # computes them: one gradient per weight over all those tokens (context plays no
            # part).
            shapes = self._sequence(c)
            tokens = sum(shapes[t][0] for t in self.w_slices().get((stage, c), ()))
            return self.w_time(stage, c, tokens)
        if action.kind == "F":
            layers = self._get(("F", c.rows, c.tokens, c.context), m.forward_time,
                               c.rows, c.tokens, c.context)
        else:
            layers = self._get(("B", c.rows, c.tokens, c.context), m.backward_time,
                               c.rows, c.tokens, c.context) + self._rerun(c, c.context, share)
        layers = layers * share + self.per_action * (1.0 - share)
        if first or last:
            edge_fn = m.edge_forward_time if action.kind == "F" else m.edge_backward_time
            layers += self._get(("E" + action.kind, c.rows, c.tokens, first, last), edge_fn,
                                c.rows, c.tokens, first, last)
        if action.kind == "B" and self.defer_wgrad:
            saving = self._shared(("WS", c.rows, c.tokens, c.context),
                                  self.cost_model.deferred_backward_saving, first, last, share)
            layers = max(0.0, layers - saving)
        return layers + self._received(action.kind, c, first, last)

    def _rerun(self, c, context: int, share: float) -> float:
        """The layer forward a backward of `c` reruns under Megatron's full recomputation, on a
        chunk of `share` of the stage's layers, before scaling by it (0 without)."""
        rerun = self.cost_model.recomputed_share(share)
        if not rerun:
            return 0.0
        return rerun * self._get(("F", c.rows, c.tokens, context), self.cost_model.forward_time,
                                 c.rows, c.tokens, context)

    def _received(self, kind: str, c, first: bool, last: bool) -> float:
        """The stage's own time on the message the cell takes (an input, but on the model's
        first virtual stage; a gradient, but on its last): the cost model's receive_time."""
        if (kind == "F" and first) or (kind == "B" and last):
            return 0.0
        return self._get(("R", c.rows, c.tokens), self.cost_model.receive_time, c.rows, c.tokens)

    def _shared(self, key: tuple, fn, first: bool, last: bool, share: float) -> float:
        """fn(*key[1:], first, last) with its layers' part scaled by `share` (a chunk's) and
        its edges' part (the output layer's, on the last stage) whole."""
        whole = self._get(key + (first, last), fn, *key[1:], first, last)
        if share == 1.0:
            return whole
        layers = self._get(key + (False, False), fn, *key[1:], False, False)
        return layers * share + (whole - layers)

    def w_time(self, stage: int, cell: Cell, tokens: int) -> float:
        """Seconds of a W action of `cell`'s sequence on `stage` over `tokens` deferred tokens."""
        if not tokens:
            return 0.0
        share = cell.share if type(cell) is VirtualCell else 1.0
        seconds = self.wgrad_share(cell.rows, tokens, first_virtual_stage(cell, stage),
                                   last_virtual_stage(cell, stage, self.num_stages), share)
        if self.host_floor is None:
            return seconds
        return max(seconds, self.host_floor.seconds("W", share))

    def wgrad_share(self, rows: int, tokens: int, first: bool, last: bool,
                    share: float = 1.0) -> float:
        """A W action's seconds over `tokens` tokens of `rows` rows, on a chunk of `share` of
        the stage's layers (1: the whole stage)."""
        return self._shared(("WG", rows, tokens, 0), self.cost_model.wgrad_time, first, last,
                            share)

    def _chunk(self, stage: int, action: Action) -> float:
        """A model chunk's share of the stage's layers, and the edges where they run."""
        c, m, kind = action.cell, self.cost_model, action.kind
        fn = m.forward_time if kind == "F" else m.backward_time
        layers = self._get((kind, c.rows, c.tokens, 0), fn, c.rows, c.tokens, 0)
        if kind == "B":
            layers += self._rerun(c, 0, 1.0 / c.num_chunks)
        layers = layers / c.num_chunks + self.per_action * (1.0 - 1.0 / c.num_chunks)
        first = stage == 0 and c.chunk == 0
        last = stage == self.num_stages - 1 and c.chunk == c.num_chunks - 1
        if first or last:
            edge_fn = m.edge_forward_time if kind == "F" else m.edge_backward_time
            layers += self._get(("E" + kind, c.rows, c.tokens, first, last), edge_fn,
                                c.rows, c.tokens, first, last)
        return layers + self._received(kind, c, first, last)

    def _sequence(self, cell: Cell) -> list[tuple[int, int]]:
        """(tokens, context) of every token slice of the cell's sequence (its microbatch's
        slicing: edge_slices cut some differently)."""
        slices = self.schedule.plan.slices_of(cell.microbatch, self.schedule.num_microbatches)
        key = (cell.batch_slice, slices[cell.batch_slice])
        out = self._sequences.get(key)
        if out is None:
            out, start = [], 0
            for t in slices[cell.batch_slice]:
                out.append((t, start))
                start += t
            self._sequences[key] = out
        return out

    def transfer(self, stage: int, action: Action) -> float:
        c = action.cell
        return self._get(("X", c.rows, c.tokens), self.cost_model.transfer_time, c.rows, c.tokens)


def _share(cell) -> float:
    """The share of a stage's layers a cell runs (a model chunk's; 1: the whole stage)."""
    if type(cell) is VirtualCell:
        return cell.share
    return 1.0 / cell.num_chunks if isinstance(cell, ChunkCell) else 1.0


def simulate_plan(plan: TeraPipePlan, cost_model: CostModel, num_microbatches: int,
                  num_stages: int, micro_batch_size: int, cores: Optional[float] = None,
                  memory: Optional[StageMemory] = None,
                  host_floor: Optional[HostFloor] = None) -> SimulationResult:
    """`simulate` of `plan`'s schedule for one run's shape."""
    schedule = build_schedule(plan, num_microbatches, num_stages, micro_batch_size)
    return simulate(schedule, cost_model, cores=cores, memory=memory, host_floor=host_floor)


def plan_time(plan: TeraPipePlan, cost_model: CostModel, num_microbatches: int,
              num_stages: int, micro_batch_size: int, cores: Optional[float] = None,
              cache: Optional[dict] = None, host_floor: Optional[HostFloor] = None) -> float:
    """Simulated iteration time of `plan`'s schedule (the planner's yardstick): `simulate`'s,
    without the memory walk. `cache`: the cost model's answers, shared across plans."""
    schedule = build_schedule(plan, num_microbatches, num_stages, micro_batch_size)
    return schedule_time(schedule, cost_model, cores, cache, host_floor)


def schedule_time(schedule: Schedule, cost_model: CostModel, cores: Optional[float] = None,
                  cache: Optional[dict] = None, host_floor: Optional[HostFloor] = None) -> float:
    """`plan_time` of a schedule already built (e.g. Megatron's interleaved one)."""
    timed = _timed(schedule, CellCosts(cost_model, schedule, cache, host_floor), cores)
    return max(ta.end for ta in timed) - min(ta.start for ta in timed) if timed else 0.0


def _timed(schedule: Schedule, costs: CellCosts, cores: Optional[float]) -> list[TimedAction]:
    if cores is not None and cores < schedule.num_stages:
        from ...schedule import shared_timeline

        return shared_timeline(schedule, costs.compute, costs.transfer, cores)
    return timeline(schedule, costs.compute, costs.transfer)


def simulate(schedule: Schedule, cost_model: CostModel,
             timed: Optional[list[TimedAction]] = None, cores: Optional[float] = None,
             memory: Optional[StageMemory] = None, megatron: bool = False,
             host_floor: Optional[HostFloor] = None) -> SimulationResult:
    """Time `schedule` under `cost_model` and track memory per stage.

    `timed` may pass a timeline already computed for this schedule and cost model. `cores`:
    the stages share this many processors (e.g. a CPU run whose processes share cores); None
    means every stage has its own device. `memory`: what the stages keep (default: the cost
    model's `CostModelMemory`). `megatron`: the cells are whole microbatches through
    Megatron's own layers (its 1F1B schedule): memory per microbatch, not per TeraPipe cell.
    `host_floor`: every action lasts at least its launches' host time (`HostFloor`; None: off).
    """
    if timed is None:
        timed = _timed(schedule, CellCosts(cost_model, schedule, host_floor=host_floor), cores)
    memory = memory_of(cost_model, memory)
    K = schedule.num_stages
    per_stage: list[list[TimedAction]] = [[] for _ in range(K)]
    for ta in timed:
        per_stage[ta.stage].append(ta)
    if timed:
        start = min(ta.start for ta in timed)
        iteration = max(ta.end for ta in timed) - start
    else:
        iteration = 0.0
    busy = [sum(ta.end - ta.start for ta in actions) for actions in per_stage]
    peaks = [walk_stage(per_stage[k], k, schedule, memory, megatron) for k in range(K)]
    return SimulationResult(schedule=schedule, timeline=tuple(timed), iteration_time=iteration,
                            busy=tuple(busy),
                            peak_activation_bytes=tuple(p.activation for p in peaks),
                            peak_kv_bytes=tuple(p.kv for p in peaks),
                            peak_memory_bytes=tuple(p.total for p in peaks),
                            memory=tuple(p.points for p in peaks))
