"""What a schedule's per-stage lists tell without timing them, with numpy: each stage's peak of
activations + K/V and its busiest stage's compute.

The budget search (memory_search.py) asks this of every leaner plan, tens of thousands of
actions each, so the memory walk (memory_walk.py) runs here as arrays: every action's changes
to the live activation and K/V bytes become one slot each of two arrays, in the walk's own
order, and a running sum (numpy's cumsum adds in order, as the walk does) gives the bytes after
every change; the walk's recorded points are a subset of those slots, and the others repeat a
recorded value, so the peaks are the walk's exactly. Byte and time values come from the
walk's and the simulator's own per-shape answers (one call per cell shape and stage kind;
on virtual stages a shape also says whether its chunk is the first or the last). Forward-only
schedules and Megatron's interleaved model chunks take the walk itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...schedule import Action, ChunkCell, Schedule, TimedAction, VirtualCell
from ..cost.cost_model import CostModel
from ..cost.recompute_memory import memory_of
from ..cost.stage_memory import StageMemory
from .memory_walk import MemoryWalk, walk_stage
from .simulator import CellCosts

_F, _B, _W = 0, 1, 2
_CODES = {"F": _F, "B": _B, "W": _W}


@dataclass(frozen=True)
class ListEstimate:
    """The busiest stage's compute (a lower bound of the simulated iteration time, as a stage
    runs its actions one after another; None when not asked for) and each stage's peak of
    activations + K/V (the memory walk depends on a stage's own order only, so it equals
    `simulate`'s)."""

    busiest_compute: Optional[float]
    peak_memory_bytes: tuple[float, ...]


@dataclass
class ListCaches:
    """The cost model's and the memory model's answers, shared by the estimates of many plans
    of one run (their keys hold everything an answer depends on)."""

    costs: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)  # a cell shape on a stage kind -> its _VALUES


_SHARED: dict[int, tuple[CostModel, Optional[StageMemory], ListCaches]] = {}


def shared_caches(cost_model: CostModel, memory: Optional[StageMemory]) -> ListCaches:
    """The caches of this cost model and memory model, shared by every search of a run (both
    orders, the hill climbs): the few most recent pairs are kept, each with its models, so an
    entry's ids cannot be reused by other objects while it lives."""
    key = id(cost_model) ^ (id(memory) << 1)
    entry = _SHARED.get(key)
    if entry is None or entry[0] is not cost_model or entry[1] is not memory:
        if len(_SHARED) >= 4:
            _SHARED.pop(next(iter(_SHARED)))
        entry = _SHARED[key] = (cost_model, memory, ListCaches())
    return entry[2]


@dataclass
class _Actions:
    """A schedule's distinct actions (stages share them) as arrays, and its cells by shape
    (cells of different microbatches share their sizes)."""

    position: dict[int, int]  # id(action) -> row of the per-action arrays
    kind: np.ndarray  # per action: _F, _B or _W
    shape: np.ndarray  # per action: its cell's shape
    seq: list  # per action: its cell's sequence key
    rows: list  # per action: its cell's rows
    cells: list  # one representative cell per shape
    first: np.ndarray  # per shape: the sequence's first token slice
    last: np.ndarray  # per shape: its last token slice
    tokens: np.ndarray  # per shape


def _actions(schedule: Schedule) -> _Actions:
    index: dict[tuple, int] = {}
    position: dict[int, int] = {}
    kind, shape, seq, rows, cells = [], [], [], [], []
    for actions in schedule.stages:
        unseen = set(map(id, actions)).difference(position)  # stages share most actions
        for a in actions if unseen else ():
            if id(a) not in unseen or id(a) in position:
                continue
            c = a.cell
            key = (c.rows, c.tokens, c.context, c.batch_slice, c.token_slice, c.num_token_slices,
                   _chunk_kind(c))
            if key not in index:
                index[key] = len(cells)
                cells.append(c)
            position[id(a)] = len(kind)
            kind.append(_CODES[a.kind])
            shape.append(index[key])
            seq.append(c.sequence_key)
            rows.append(c.rows)
    return _Actions(position, np.array(kind, np.int8), np.array(shape, np.int64), seq, rows,
                    cells, np.array([c.is_first_token_slice for c in cells], bool),
                    np.array([c.is_last_token_slice for c in cells], bool),
                    np.array([c.tokens for c in cells], np.int64))


def _chunk_kind(cell) -> Optional[tuple]:
    """On virtual stages, (first chunk, last chunk, chunks, V-shaped, the chunk's share of the
    layers): what of a cell's chunk its costs and bytes depend on with the stage (first and
    last virtual stages run the edges); else None."""
    chunks = getattr(cell, "num_chunks", None)
    if chunks is None:
        return None
    share = cell.share if isinstance(cell, VirtualCell) else 1.0 / chunks
    return cell.chunk == 0, cell.chunk == chunks - 1, chunks, getattr(cell, "v_shape", False), share


_BYTES = ("cell", "kv", "kv_grad", "hold", "rise")
_TIMES = ("F", "B")


def _per_shape(walk: MemoryWalk, costs: CellCosts, stage: int, known: _Actions,
               cache: dict, with_times: bool) -> dict:
    """Bytes (and with_times, seconds) of every shape on `stage`: the walk's and the
    simulator's answers. Times are asked only of plans that fit: most of the cost model's
    calls are theirs."""
    seq_lengths = [sum(t) for t in costs.token_slices]
    kind = (stage == 0, stage == costs.num_stages - 1, costs.defer_wgrad)
    rows, times = [], []
    for c in known.cells:
        last = c.is_last_token_slice  # only a last slice's backward lifts the K/V gradients
        key = (c.rows, c.tokens, c.context, seq_lengths[c.batch_slice], last, kind,
               _chunk_kind(c))
        row = cache.get(key)
        if row is None:
            row = cache[key] = (*(walk.cell_value(what, c) for what in _BYTES[:4]),
                                walk.cell_value("rise" if last else "slice_rise", c))
        rows.append(row)
        if with_times:
            seconds = cache.get(("time",) + key)
            if seconds is None:
                seconds = cache[("time",) + key] = tuple(
                    costs.compute(stage, Action(k, c)) for k in _TIMES)
            times.append(seconds)
    table = np.array(rows, dtype=float).reshape(len(rows), len(_BYTES))
    values = {what: table[:, i] for i, what in enumerate(_BYTES)}
    if with_times:
        table = np.array(times, dtype=float).reshape(len(times), len(_TIMES))
        values.update({what: table[:, i] for i, what in enumerate(_TIMES)})
    return values


def _w_pass(costs: CellCosts, stage: int, known: _Actions, rows: list, kinds: list,
            tokens: list, hold: list, with_times: bool) -> tuple[list, list]:
    """Per B or W action of a stage (`rows`: their rows of the per-action arrays, in order):
    a W's time over the tokens its sequence backwarded since its last W (with_times), and
    what that W frees (`hold` summed in order, as the walk does); 0 at B actions."""
    times, freed = [0.0] * len(rows), [0.0] * len(rows)
    tokens_since: dict = {}
    held_since: dict = {}
    for j, (r, kind) in enumerate(zip(rows, kinds)):
        seq = known.seq[r]
        if kind == _B:
            tokens_since[seq] = tokens_since.get(seq, 0) + tokens[j]
            held_since[seq] = held_since.get(seq, 0.0) + hold[j]
        else:
            n = tokens_since.pop(seq, 0)
            if with_times and n:
                times[j] = costs.w_time(stage, known.cells[known.shape[r]], n)
            freed[j] = held_since.pop(seq, 0.0)
    return times, freed


def _stage(schedule: Schedule, stage: int, known: _Actions, values: dict,
           costs: CellCosts) -> tuple[Optional[float], float]:
    """(compute, or None when `values` hold no times; peak of activations + K/V) of one
    stage's list."""
    actions = schedule.stages[stage]
    n = len(actions)
    with_times = "F" in values
    if n == 0:
        return (0.0 if with_times else None), 0.0
    rows = np.fromiter(map(known.position.__getitem__, map(id, actions)), np.int64, n)
    kinds, shape = known.kind[rows], known.shape[rows]
    is_f, is_b, is_w = kinds == _F, kinds == _B, kinds == _W
    first, last = known.first[shape], known.last[shape]
    v = {k: a[shape] for k, a in values.items()}
    times = np.where(is_f, v["F"], np.where(is_b, v["B"], 0.0)) if with_times else None
    has_w = bool(is_w.any())
    freed = None
    if has_w:  # W actions: a pass over the B and W actions, in order
        bw = np.flatnonzero(~is_f)
        w_times, w_freed = _w_pass(costs, stage, known, rows[bw].tolist(), kinds[bw].tolist(),
                                   known.tokens[shape[bw]].tolist(), v["hold"][bw].tolist(),
                                   with_times)
        if with_times:
            times[bw] += np.asarray(w_times)
        freed = np.zeros(n)
        freed[bw] = w_freed
    compute = float(np.cumsum(times)[-1]) if with_times else None
    # a backward's highest point: its rise above the bytes before it, the K/V gradients of a
    # last slice's backward counted on the K/V side
    drop = np.where(last, v["kv_grad"], 0.0) - v["rise"]
    act = np.zeros((n, 4))  # the walk's changes to the activation bytes, in its order
    kv = np.zeros((n, 2))  # and to the K/V bytes
    act[:, 0] = np.where(is_f, v["cell"], np.where(is_b, -drop, 0.0))
    if schedule.defer_wgrad and freed is not None:
        act[:, 0] -= freed
    act[:, 1] = np.where(is_b, drop, 0.0)
    act[:, 2] = np.where(is_b, -v["cell"], 0.0)
    if schedule.defer_wgrad:
        act[:, 3] = np.where(is_b, v["hold"], 0.0)
    kv[:, 0] = np.where(is_f & first, v["kv"], np.where(is_b & last, v["kv_grad"], 0.0))
    kv[:, 1] = np.where(is_b & first, -(v["kv"] + v["kv_grad"]), 0.0)
    act_after = np.cumsum(act.ravel()).reshape(n, 4)
    kv_after = np.cumsum(kv.ravel()).reshape(n, 2)
    # recorded: after a forward or a W, at a backward's highest point, after a backward
    totals = np.concatenate([act_after[:, 0] + kv_after[:, 0], act_after[:, 3] + kv_after[:, 1]])
    return compute, max(0.0, float(totals.max()))


def estimate_lists(schedule: Schedule, cost_model: CostModel,
                   memory: Optional[StageMemory] = None,
                   caches: Optional[ListCaches] = None, with_times: bool = True) -> ListEstimate:
    """`ListEstimate` of `schedule` (no lowering, no replay); used to skip timing plans that
    cannot fit. `caches`: shared with other plans' estimates. with_times=False: the peaks
    alone (busiest_compute None), without most of the cost model's calls."""
    caches = caches if caches is not None else ListCaches()
    costs = CellCosts(cost_model, schedule, caches.costs)
    memory = memory_of(cost_model, memory)
    if schedule.forward_only or any(isinstance(a.cell, ChunkCell)
                                    for actions in schedule.stages for a in actions[:1]):
        walked = _walked(schedule, costs, memory)
        return walked if with_times else ListEstimate(None, walked.peak_memory_bytes)
    known = _actions(schedule)
    busy, peaks, by_kind = [], [], {}
    for k in range(schedule.num_stages):
        kind = (k == 0, k == schedule.num_stages - 1)
        if kind not in by_kind:
            walk = MemoryWalk(memory, schedule, k, False, caches.memory)
            by_kind[kind] = _per_shape(walk, costs, k, known, caches.shapes, with_times)
        compute, peak = _stage(schedule, k, known, by_kind[kind], costs)
        busy.append(compute)
        peaks.append(peak)
    return ListEstimate(max(busy, default=0.0) if with_times else None, tuple(peaks))


def _walked(schedule: Schedule, costs: CellCosts, memory: StageMemory) -> ListEstimate:
    """The same from the walk itself, action by action."""
    busy, peaks = [], []
    for k, actions in enumerate(schedule.stages):
        clock, timed = 0.0, []
        for a in actions:
            duration = costs.compute(k, a)
            timed.append(TimedAction(k, a, clock, clock + duration))
            clock += duration
        busy.append(clock)
        peaks.append(walk_stage(timed, k, schedule, memory).total)
    return ListEstimate(max(busy, default=0.0), tuple(peaks))
