"""Live bytes on one stage over an iteration: its actions walked in order with a StageMemory
(cost/stage_memory.py says what each action allocates and frees, as the runtime does).

TeraPipe cells:
- F: the cell's activations; the forward of a sequence's first token slice also allocates the
  sequence's K/V buffers (the whole sequence, every layer of the stage). Forward-only: the
  activations go at the end of the forward, the K/V after the sequence's last slice.
- B: the sequence's first backward (its last slice's) allocates the K/V gradient buffers, layer
  by layer while it frees the cell's activations (StageMemory.backward_rise, which also brings
  back a recomputed group's activations in any backward: recompute_memory.py); the cell's
  activations go (with deferred weight gradients, what the W action needs stays); the
  backward of the first slice frees the sequence's K/V and their gradients.
- W: frees what the sequence's backwards left for it.
Megatron's own schedules (`megatron=True`, and every ChunkCell of the interleaved schedule):
a whole microbatch keeps `microbatch_bytes` from its forward until its backward (and, with
recomputation, its backward first rises by `microbatch_backward_rise`).
TeraPipe's virtual stages (VirtualCell) are walked as TeraPipe cells on 1/V of the stage's
layers: activations, K/V, their gradients and what waits for the W action per (sequence,
chunk); the output layer's bytes only on the model's last virtual stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...schedule import Cell, ChunkCell, Schedule, TimedAction, VirtualCell
from ...schedule.actions import first_virtual_stage, last_virtual_stage
from ..cost.stage_memory import StageMemory


@dataclass(frozen=True)
class MemoryPoint:
    """Live bytes on one stage right after an allocation or a release."""

    time: float
    activation_bytes: float
    kv_bytes: float


@dataclass(frozen=True)
class StagePeaks:
    points: tuple[MemoryPoint, ...]
    activation: float  # peak of activations (and what waits for W actions)
    kv: float  # peak of K/V and their gradients
    total: float  # peak of the two together


#: what a StageMemory answer depends on: the cache key of each kind of answer
_KEYS = {
    "cell": lambda r, t, c, s, f, l, n, d: ("cell", r, t, c, f, l, n),
    "kv": lambda r, t, c, s, f, l, n, d: ("kv", r, s, n),
    "whole_kv": lambda r, t, c, s, f, l, n, d: ("whole_kv", r, s, n),
    "kv_grad": lambda r, t, c, s, f, l, n, d: ("kv_grad", r, s, n),
    "hold": lambda r, t, c, s, f, l, n, d: ("hold", r, t, f, l, n),
    "whole": lambda r, t, c, s, f, l, n, d: ("whole", r, t, f, l, n),
    "rise": lambda r, t, c, s, f, l, n, d: ("rise", r, t, c, s, f, l, d, n),
    "slice_rise": lambda r, t, c, s, f, l, n, d: ("slice_rise", r, t, c, f, l, d, n),
    "whole_rise": lambda r, t, c, s, f, l, n, d: ("whole_rise", r, t, f, l, n),
}


class MemoryWalk:
    """One stage's running totals and the StageMemory's answers for its cells."""

    def __init__(self, memory: StageMemory, schedule: Schedule, stage: int, megatron: bool,
                 cache: Optional[dict] = None):
        """`cache`: answers of `memory` to share with other walks (every stage, other plans);
        its keys hold everything an answer depends on."""
        self.memory, self.schedule, self.stage = memory, schedule, stage
        self.megatron = megatron
        self.seq_lengths = [sum(ts) for ts in schedule.plan.token_slices]
        self.act = self.kv = 0.0
        self.peak_a = self.peak_kv = self.peak_t = 0.0
        self.points: list[MemoryPoint] = []
        self.held: dict[tuple[int, int], float] = {}  # sequence -> bytes waiting for its W
        self._cache: dict[tuple, float] = {} if cache is None else cache
        self._stage_where = (stage == 0, stage == schedule.num_stages - 1, None)  # TeraPipe cells

    def record(self, time: float) -> None:
        self.peak_a = max(self.peak_a, self.act)
        self.peak_kv = max(self.peak_kv, self.kv)
        self.peak_t = max(self.peak_t, self.act + self.kv)
        self.points.append(MemoryPoint(time, self.act, self.kv))

    def _where(self, cell: Cell) -> tuple[bool, bool, Optional[float]]:
        """(first, last, layers) of the cell on this stage (a model chunk has its share)."""
        K = self.schedule.num_stages
        if isinstance(cell, (ChunkCell, VirtualCell)):
            share = cell.share if isinstance(cell, VirtualCell) else 1.0 / cell.num_chunks
            layers = getattr(self.memory, "layers_per_stage", 1) * share
            return (first_virtual_stage(cell, self.stage),
                    last_virtual_stage(cell, self.stage, K), layers)
        return self.stage == 0, self.stage == K - 1, None

    def cell_value(self, what: str, cell: Cell) -> float:
        """`what` (cell, kv, whole_kv, kv_grad, hold, whole, rise, slice_rise, whole_rise) of
        `cell` on this stage, cached. rise: a backward that allocates the sequence's K/V
        gradients (its last slice's); slice_rise: any other backward."""
        if cell.num_token_slices == 1 and what in ("kv", "kv_grad", "rise"):
            # A sequence of one slice has no K/V buffers (runtime/attention/slice_attention.py): its attention
            # saves its K/V, and their gradients live within a layer's backward, as Megatron's.
            return (0.0 if what == "kv_grad" else
                    self.cell_value("whole_kv" if what == "kv" else "slice_rise", cell))
        first, last, layers = (self._stage_where if type(cell) is Cell else self._where(cell))
        seq = self.seq_lengths[cell.batch_slice]
        key = _KEYS[what](cell.rows, cell.tokens, cell.context, seq, first, last, layers,
                          self.schedule.defer_wgrad)
        value = self._cache.get(key)
        if value is None:
            m = self.memory
            value = {
                "cell": lambda: m.cell_bytes(cell.rows, cell.tokens, cell.context, first, last, layers),
                "kv": lambda: m.kv_buffer_bytes(cell.rows, seq, layers),
                "whole_kv": lambda: m.whole_sequence_kv_bytes(cell.rows, seq, layers),
                "kv_grad": lambda: m.kv_grad_bytes(cell.rows, seq, layers),
                "hold": lambda: m.wgrad_hold_bytes(cell.rows, cell.tokens, first, last, layers),
                "whole": lambda: m.microbatch_bytes(cell.rows, cell.tokens, first, last, layers),
                "rise": lambda: m.backward_rise(cell.rows, cell.tokens, cell.context, seq, first,
                                                last, self.schedule.defer_wgrad, layers),
                "slice_rise": lambda: m.backward_rise(cell.rows, cell.tokens, cell.context, seq,
                                                      first, last, self.schedule.defer_wgrad,
                                                      layers, kv_grads=False),
                "whole_rise": lambda: m.microbatch_backward_rise(cell.rows, cell.tokens, first,
                                                                 last, layers),
            }[what]()
            if not value >= 0:
                raise ValueError(f"memory model {m.describe()} gave {value} bytes for {what} of "
                                 f"cell {cell}; sizes must be non-negative")
            self._cache[key] = value
        return value

    def peak_with(self, ta: TimedAction) -> float:
        """The highest activations + K/V the walk records if a TeraPipe cell's `ta` runs next;
        the walk is left as it was (the W placement's budget check)."""
        saved = (self.act, self.kv, self.peak_a, self.peak_kv, self.peak_t)
        n, seq = len(self.points), ta.action.cell.sequence_key
        held = self.held.get(seq)
        self.terapipe(ta)
        peak = max(p.activation_bytes + p.kv_bytes for p in self.points[n:])
        del self.points[n:]
        self.act, self.kv, self.peak_a, self.peak_kv, self.peak_t = saved
        if held is None:
            self.held.pop(seq, None)
        else:
            self.held[seq] = held
        return peak

    def whole(self, ta: TimedAction) -> None:
        """Megatron's schedules: a microbatch's activations from its forward to its backward."""
        size = self.cell_value("whole", ta.action.cell)
        if ta.action.kind == "F":
            self.act += size
            self.record(ta.start)
            if self.schedule.forward_only:
                self.act -= size
                self.record(ta.end)
        elif ta.action.kind == "B":
            rise = self.cell_value("whole_rise", ta.action.cell)
            if rise:  # a recomputed group's activations, back for its backward
                self.act += rise
                self.record(ta.start)
                self.act -= rise
            self.act -= size
            self.record(ta.end)

    def terapipe(self, ta: TimedAction) -> None:
        a, c = ta.action, ta.action.cell
        seq = c.sequence_key
        if a.kind == "W":
            self.act -= self.held.pop(seq, 0.0)
            self.record(ta.end)
        elif a.kind == "F":
            self.act += self.cell_value("cell", c)
            if c.is_first_token_slice:
                self.kv += self.cell_value("kv", c)
            self.record(ta.start)
            if self.schedule.forward_only:
                self.act -= self.cell_value("cell", c)
                if c.is_last_token_slice:
                    self.kv -= self.cell_value("kv", c)
                self.record(ta.end)
        else:
            if c.is_last_token_slice:
                # The K/V gradient buffers appear layer by layer as this backward frees the
                # cell's activations from the top: the point where the two together peak.
                grads, rise = self.cell_value("kv_grad", c), self.cell_value("rise", c)
                self.kv += grads
                self.act -= grads - rise
                self.record(ta.start)
                self.act += grads - rise
            else:
                rise = self.cell_value("slice_rise", c)
                if rise:  # a recomputed group's activations, back for its backward
                    self.act += rise
                    self.record(ta.start)
                    self.act -= rise
            self.act -= self.cell_value("cell", c)
            if self.schedule.defer_wgrad:
                hold = self.cell_value("hold", c)
                self.act += hold
                self.held[seq] = self.held.get(seq, 0.0) + hold
            if c.is_first_token_slice:
                self.kv -= self.cell_value("kv", c) + self.cell_value("kv_grad", c)
            self.record(ta.end)


def walk_stage(timed: list[TimedAction], stage: int, schedule: Schedule, memory: StageMemory,
               megatron: bool = False) -> StagePeaks:
    """Walk one stage's timed actions (in its own order) and return its memory over time."""
    walk = MemoryWalk(memory, schedule, stage, megatron)
    for ta in timed:
        if megatron or isinstance(ta.action.cell, ChunkCell):
            walk.whole(ta)
        else:
            walk.terapipe(ta)
    return StagePeaks(tuple(walk.points), walk.peak_a, walk.peak_kv, walk.peak_t)
