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
class MegatronCall:
    """One step of Megatron's interleaved loop on a rank (the non-overlapped P2P path): its
    compute actions, then one blocking `P2PCommunicator._communicate` call that sends what
    the step computed and receives what the neighbours send in their aligned step."""

    computes: tuple[tuple[str, int, int], ...]  # (kind, microbatch, chunk)
    send_next: bool = False  # the forward's output, to rank + 1
    send_prev: bool = False  # the backward's input gradient, to rank - 1
    recv_prev: bool = False  # an activation from rank - 1
    recv_next: bool = False  # a gradient from rank + 1


def megatron_calls(rank: int, num_stages: int, num_microbatches: int, num_chunks: int,
                   group_size: int, forward_only: bool = False) -> list[MegatronCall]:
    """The steps of Megatron-Core's interleaved schedule on `rank`, with what each step's
    communication call sends and receives (schedules.py: its warm-up, steady and cool-down
    loops without P2P overlap, and `recv_tensor_from_previous_stage`). A receive need not be
    for the rank's next compute: the first rank receives, every step, what the last rank sent
    in the aligned step, and queues it; each call blocks until its messages have arrived."""
    K, v, first, last = num_stages, num_chunks, rank == 0, rank == num_stages - 1
    table = schedule_table(num_microbatches, v, group_size)
    total = len(table)
    warmup = total if forward_only else min(total, (K - rank - 1) * 2 + (v - 1) * group_size)
    remaining = total - warmup

    def chunk(k: int, forward: bool) -> int:
        c = table[k % total][1]
        return c if forward else v - 1 - c

    def receives(k: int, forward: bool) -> bool:  # recv_tensor_from_previous_stage
        if not (first if forward else last):
            return True
        return k >= K - 1 and chunk(k - (K - 1), forward) != ((v - 1) if forward else 0)

    def sends(k: int, forward: bool) -> bool:  # not the model's first or last virtual stage
        return not (last and chunk(k, True) == v - 1) if forward else \
            not (first and chunk(k, False) == 0)

    def f(k: int) -> tuple[str, int, int]:
        return ("F", table[k][0], table[k][1])

    def b(k: int) -> tuple[str, int, int]:
        return ("B", table[k][0], v - 1 - table[k][1])

    calls = [] if first else [MegatronCall((), recv_prev=True)]  # the first recv_forward
    for k in range(warmup):
        fused = k == warmup - 1 and not forward_only and remaining > 0
        calls.append(MegatronCall((f(k),), send_next=sends(k, True),
                                  recv_prev=receives(k, True) and k != total - 1,
                                  recv_next=fused and not last))
    for k in range(remaining):
        calls.append(MegatronCall((f(k + warmup), b(k)), sends(k + warmup, True), sends(k, False),
                                  receives(k + warmup, True) and k != remaining - 1,
                                  receives(k, False)))
    if not forward_only and remaining == 0 and not last:  # all in the warm-up: recv_backward
        calls.append(MegatronCall((), recv_next=True))
    for k in range(remaining, 0 if forward_only else total):
        calls.append(MegatronCall((b(k),), send_prev=sends(k, False),
                                  recv_next=receives(k, False) and k != total - 1))
    return calls


@dataclass(frozen=True)
class InterleavedSchedule(Schedule):
    """Megatron's interleaved 1F1B: `stages[k]` is rank k's compute actions on ChunkCells."""

    num_chunks: int = 2
    group_size: int = 2

    def lowered(self, lowering: Lowering = Lowering()) -> tuple[tuple[Action, ...], ...]:
        """Every rank's list as Megatron runs it: each step's compute actions, its sends, then
        the receives of its communication call (the rank waits for all of them before its next
        step). Which cell a receive is for follows from the neighbour's sends, in order."""
        K = self.num_stages
        cells = {(a.cell.microbatch, a.cell.chunk): a.cell for a in self.stages[0]}
        calls = [megatron_calls(k, K, self.num_microbatches, self.num_chunks, self.group_size,
                                self.forward_only) for k in range(K)]
        sent = [self._sent(k, calls[k], cells) for k in range(K)]
        queues = {(k, d): iter(sent[(k - 1) % K if d == "F" else (k + 1) % K][d])
                  for k in range(K) for d in ("F", "B")}
        out = []
        for k in range(K):
            actions: list[Action] = []
            for call, sends in zip(calls[k], self._sends_per_call(k, calls[k])):
                actions += [Action(kind, cells[m, c]) for kind, m, c in call.computes]
                actions += [send(d, cells[key]) for d, key in sends]
                actions += [recv(d, next(queues[k, d])) for d, wanted in
                            (("F", call.recv_prev), ("B", call.recv_next)) if wanted]
            out.append(tuple(actions))
        return tuple(out)

    def _sends_per_call(self, rank: int, calls: list[MegatronCall]) -> list[list[tuple]]:
        """Per call, (direction, the receiver's (microbatch, chunk)) of each message it sends."""
        return [[(kind, self._receiver(m, c, rank, kind)) for kind, m, c in call.computes
                 if (call.send_next if kind == "F" else call.send_prev)] for call in calls]

    def _sent(self, rank: int, calls: list[MegatronCall], cells: dict) -> dict[str, list[Cell]]:
        """The receivers' cells of every message `rank` sends, per direction, in order."""
        out: dict[str, list[Cell]] = {"F": [], "B": []}
        for sends in self._sends_per_call(rank, calls):
            for d, key in sends:
                out[d].append(cells[key])
        return out

    def _receiver(self, microbatch: int, chunk: int, rank: int, kind: str) -> tuple[int, int]:
        """(microbatch, chunk) of the cell the neighbouring virtual stage receives this
        cell's message for: the last rank feeds the first rank's next chunk, and back."""
        if kind == "F":
            return microbatch, chunk + (1 if rank == self.num_stages - 1 else 0)
        return microbatch, chunk - (1 if rank == 0 else 0)


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
