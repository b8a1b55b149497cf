"""Megatron-Core's interleaved 1F1B schedule as per-rank action lists, for the timing engines.

With K pipeline ranks and v model chunks per rank, rank k holds virtual stages k, k + K, ...,
k + (v - 1) K, each with 1/v of the rank's layers. A microbatch goes forward through the virtual
stages in order, so the forward of virtual stage s needs that of s - 1, on rank (s - 1) % K: the
last rank hands each microbatch to the first rank's next chunk. The order each rank runs is
Megatron-Core's (pipeline_parallel/schedules.py, forward_backward_pipelining_with_interleaving):

- the schedule table (`get_schedule_table`) lists (microbatch, chunk) per virtual microbatch:
  microbatches in groups of `group_size` (config.microbatch_group_size_per_vp_stage, default K),
  each group through chunk 0, then chunk 1, ...; the last group takes whatever is left;
- rank k runs (K - k - 1) * 2 + (v - 1) * group_size forwards of warm-up (at most all M v),
  then one forward and one backward in turn, then the backwards left; the j-th backward is
  that of the j-th table entry with its chunk mirrored (v - 1 - chunk).

Megatron runs this schedule itself; we only time it. Its cells are `ChunkCell`s (one whole
microbatch on one chunk), and its lowered lists (`InterleavedSchedule.lowered`) send each
message to the rank that runs the next (F) or previous (B) virtual stage, naming the cell that
rank receives it for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..plan import TeraPipePlan
from .actions import Action, Cell, Schedule, recv, send
from .lower import Lowering


@dataclass(frozen=True)
class ChunkCell(Cell):
    """A cell on one model chunk: virtual stage chunk * num_stages + rank."""

    chunk: int = 0
    num_chunks: int = 1

    def virtual_stage(self, rank: int, num_stages: int) -> int:
        return self.chunk * num_stages + rank

    def __str__(self) -> str:
        return f"m{self.microbatch}c{self.chunk}"


def check_interleaved(num_microbatches: int, num_stages: int, num_chunks: int,
                      group_size: Optional[int] = None) -> int:
    """Megatron-Core's conditions for its interleaved schedule; returns the group size.
    Raises ValueError naming what does not hold."""
    group = num_stages if group_size is None else int(group_size)
    if num_stages < 2:
        raise ValueError(f"the interleaved schedule needs at least 2 pipeline stages, got {num_stages}")
    if num_chunks < 2:
        raise ValueError(f"the interleaved schedule needs at least 2 model chunks per stage, got {num_chunks}")
    if num_microbatches < num_stages:
        raise ValueError(
            f"Megatron's interleaved schedule needs at least {num_stages} microbatches (one per "
            f"pipeline stage), got {num_microbatches}: use at least {num_stages} microbatches")
    if group > num_microbatches or group < num_stages:
        raise ValueError(
            f"Megatron's interleaved schedule needs between {num_stages} (pipeline stages) and "
            f"{num_microbatches} (microbatches) contiguous microbatches per virtual stage, got "
            f"{group}: set --microbatch-group-size-per-virtual-pipeline-stage in that range")
    last = num_microbatches % group
    if 0 < last < num_stages:
        raise ValueError(
            f"Megatron's interleaved schedule needs the microbatches ({num_microbatches}) to "
            f"leave a last group of 0 or at least {num_stages} (pipeline stages) when grouped "
            f"by {group}; {last} are left")
    return group


def schedule_table(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) per virtual microbatch id, as Megatron's get_schedule_table."""
    table = []
    for first in range(0, num_microbatches, group_size):
        end = num_microbatches if first + group_size >= num_microbatches else first + group_size
        table += [(m, c) for c in range(num_chunks) for m in range(first, end)]
    return table


def rank_order(rank: int, num_stages: int, num_microbatches: int, num_chunks: int,
               group_size: int, forward_only: bool = False) -> list[tuple[str, int, int]]:
    """(kind, microbatch, chunk) in the order Megatron's interleaved schedule runs them on
    `rank`."""
    table = schedule_table(num_microbatches, num_chunks, group_size)
    total = len(table)
    forwards = [("F", m, c) for m, c in table]
    if forward_only:
        return forwards
    backwards = [("B", m, num_chunks - 1 - c) for m, c in table]
    warmup = min(total, (num_stages - rank - 1) * 2 + (num_chunks - 1) * group_size)
    order = forwards[:warmup]
    for j in range(total - warmup):
        order += [forwards[warmup + j], backwards[j]]
    return order + backwards[total - warmup:]


@dataclass(frozen=True)
class InterleavedSchedule(Schedule):
    """Megatron's interleaved 1F1B: `stages[k]` is rank k's compute actions on ChunkCells."""

    num_chunks: int = 2
    group_size: int = 2

    def lowered(self, lowering: Lowering = Lowering()) -> tuple[tuple[Action, ...], ...]:
        """Every rank's list with its receives and sends (lowering choices do not change the
        times; plain SEND / RECV here)."""
        return tuple(self._lower_rank(k) for k in range(self.num_stages))

    def _lower_rank(self, rank: int) -> tuple[Action, ...]:
        K, last = self.num_stages, self.num_stages * self.num_chunks - 1
        out: list[Action] = []
        for action in self.stages[rank]:
            cell = action.cell
            assert isinstance(cell, ChunkCell)
            stage = cell.virtual_stage(rank, K)
            receives = stage > 0 if action.kind == "F" else stage < last
            sends = stage < last if action.kind == "F" else stage > 0
            if receives:
                out.append(recv(action.kind, cell))
            out.append(action)
            if sends:
                out.append(send(action.kind, self._receivers_cell(cell, rank, action.kind)))
        return tuple(out)

    def _receivers_cell(self, cell: ChunkCell, rank: int, kind: str) -> ChunkCell:
        """The cell the neighbouring virtual stage receives this cell's message for."""
        K = self.num_stages
        if kind == "F":
            chunk = cell.chunk + (1 if rank == K - 1 else 0)
        else:
            chunk = cell.chunk - (1 if rank == 0 else 0)
        return _chunk_cell(cell.microbatch, chunk, self.num_chunks, cell.rows, cell.tokens)


def _chunk_cell(microbatch: int, chunk: int, num_chunks: int, rows: int, tokens: int) -> ChunkCell:
    return ChunkCell(microbatch, 0, 0, 0, rows, 0, tokens, 1, chunk, num_chunks)


def build_interleaved_schedule(seq_length: int, num_microbatches: int, num_stages: int,
                               num_chunks: int, micro_batch_size: int,
                               group_size: Optional[int] = None,
                               forward_only: bool = False) -> InterleavedSchedule:
    """Megatron-Core's interleaved 1F1B on `num_stages` ranks with `num_chunks` model chunks
    each (whole microbatches: no token slices). Raises ValueError where Megatron would."""
    group = check_interleaved(num_microbatches, num_stages, num_chunks, group_size)
    cells = {(m, c): _chunk_cell(m, c, num_chunks, micro_batch_size, seq_length)
             for m in range(num_microbatches) for c in range(num_chunks)}
    stages = tuple(
        tuple(Action(kind, cells[(m, c)])
              for kind, m, c in rank_order(k, num_stages, num_microbatches, num_chunks, group,
                                           forward_only))
        for k in range(num_stages))
    plan = TeraPipePlan([seq_length], order="1f1b", defer_wgrad=False)  # no W actions
    return InterleavedSchedule(plan, num_microbatches, micro_batch_size, forward_only, stages,
                               num_chunks=num_chunks, group_size=group)
