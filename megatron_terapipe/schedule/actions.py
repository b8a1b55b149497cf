"""What a schedule is made of: cells, the actions stages run on them, and the schedule itself.

A cell is (microbatch, batch slice, token slice). A schedule gives every stage its ordered
compute actions: forward (F), backward (B) and, when the plan defers weight gradients, W.
Lowering (lower.py) adds the communication actions that move activations (direction "F", to
the next stage) and gradients (direction "B", to the previous stage) between them.

An action is written one way everywhere (errors, the stage x step grid, traces, schedule
files, the running action's label): `format_action` writes it, `parse_action` reads it back.

    KIND(CELL)              F(m0b0t1), B(m0b0t1), SEND_F(m0b0t1), RECV_B(m1b0t0), POST_F(m0b0t2)
    KIND(CELL, RECV_CELL)   SEND_F_RECV_B(m0b0t1, m0b0t0): sends m0b0t1's activation and
                            receives m0b0t0's gradient in one call (SEND_B_RECV_F likewise)
    W(CELL)                 W(m0b0t0): the deferred weight gradients of sequence (m0, b0), run
                            after the backward of its token slice 0 (its last W); W(m0b0t3) an
                            early W after slice 3's backward (the plan's wgrad_points)

CELL is m<microbatch>b<batch slice>t<token slice>; on virtual stages (a plan's
virtual_stages V > 1: V model chunks per rank) a TeraPipe cell also names its chunk,
m<microbatch>b<batch slice>t<token slice>c<chunk> (`VirtualCell`); a cell of Megatron's
interleaved schedule (interleaved.py, whole microbatches) is m<microbatch>c<model chunk>.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Iterable, Mapping, Optional, Union

from ..plan import TeraPipePlan


class ActionKind(str, Enum):
    """What an action does. A str enum: a kind equals, hashes and prints as its name ("F",
    "SEND_F", ...), so traces, grids and JSON read as before, while a misspelt kind is an error
    where the action is made."""

    F = "F"  # forward of a cell
    B = "B"  # backward of a cell
    W = "W"  # the deferred weight gradients of a sequence
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    POST_F = "POST_F"  # post the receive early, before the compute it overlaps
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    POST_B = "POST_B"
    SEND_F_RECV_B = "SEND_F_RECV_B"  # fused: send an activation, receive a gradient
    SEND_B_RECV_F = "SEND_B_RECV_F"  # fused: send a gradient, receive an activation

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


COMPUTE_KINDS = (ActionKind.F, ActionKind.B, ActionKind.W)
# Communication kinds -> (operation, direction of the message). A fused SEND_x_RECV_y sends in
# direction x and receives the opposite message from the same neighbour in one call.
COMM_KINDS = {
    ActionKind.SEND_F: ("SEND", "F"), ActionKind.RECV_F: ("RECV", "F"),
    ActionKind.POST_F: ("POST", "F"), ActionKind.SEND_B: ("SEND", "B"),
    ActionKind.RECV_B: ("RECV", "B"), ActionKind.POST_B: ("POST", "B"),
    ActionKind.SEND_F_RECV_B: ("SEND_RECV", "F"), ActionKind.SEND_B_RECV_F: ("SEND_RECV", "B"),
}


def opposite(direction: str) -> str:
    return "B" if direction == "F" else "F"


@dataclass(frozen=True)
class Cell:
    """One unit of pipeline work: some rows and some tokens of one microbatch."""

    microbatch: int
    batch_slice: int
    token_slice: int
    row_start: int
    rows: int
    token_start: int
    tokens: int
    num_token_slices: int  # token slices in this (microbatch, batch slice)

    @property
    def context(self) -> int:
        """Tokens before this slice, whose K/V it attends to."""
        return self.token_start

    @property
    def token_end(self) -> int:
        return self.token_start + self.tokens

    @property
    def row_end(self) -> int:
        return self.row_start + self.rows

    @property
    def sequence_key(self) -> tuple[int, int]:
        """Identifies the sequence rows this cell belongs to (its K/V cache)."""
        return (self.microbatch, self.batch_slice)

    @property
    def is_first_token_slice(self) -> bool:
        return self.token_slice == 0

    @property
    def is_last_token_slice(self) -> bool:
        return self.token_slice == self.num_token_slices - 1

    def __str__(self) -> str:
        return f"m{self.microbatch}b{self.batch_slice}t{self.token_slice}"


@dataclass(frozen=True)
class VirtualCell(Cell):
    """A TeraPipe cell on one model chunk of a rank (plans with virtual_stages V > 1). Each
    chunk has its own layers, so its own K/V cache and its own weight gradients: the sequence
    key names the chunk. Where the chunks sit (`v_shape`, the plan's virtual_placement):

    - ring (default): rank k holds chunks 0..V-1, chunk c being virtual stage c * K + k of the
      K * V the model is cut into; the last rank hands a cell to the first rank's next chunk.
    - V (v_shape, V = 2): rank k holds virtual stages k (chunk 0) and 2K - 1 - k (chunk 1): a
      cell goes down the ranks on chunk 0, turns on the last rank (a hand-over within the
      rank, no message) and comes back up on chunk 1; rank 0 runs the embedding and the loss.

    chunk_shares: each chunk's part of the stage's layers (None: 1 / V each, equal chunks)."""

    chunk: int = 0
    num_chunks: int = 1
    v_shape: bool = False
    chunk_shares: Optional[tuple[float, ...]] = None

    @property
    def sequence_key(self) -> tuple[int, int, int]:
        """The sequence's rows on this chunk: its K/V cache and its W action are per chunk."""
        return (self.microbatch, self.batch_slice, self.chunk)

    @property
    def share(self) -> float:
        """The chunk's part of its stage's layers."""
        return 1.0 / self.num_chunks if self.chunk_shares is None else self.chunk_shares[self.chunk]

    def virtual_stage(self, rank: int, num_stages: int) -> int:
        if self.v_shape:
            return rank if self.chunk == 0 else 2 * num_stages - 1 - rank
        return self.chunk * num_stages + rank

    def __str__(self) -> str:
        return f"m{self.microbatch}b{self.batch_slice}t{self.token_slice}c{self.chunk}"


def first_virtual_stage(cell: Cell, stage: int) -> bool:
    """Whether `stage` runs the model's first layers for `cell` (no input message; the
    embedding): stage 0, and on virtual stages only its chunk 0."""
    return stage == 0 and getattr(cell, "chunk", 0) == 0


def last_virtual_stage(cell: Cell, stage: int, num_stages: int) -> bool:
    """Whether `stage` runs the model's last layers for `cell` (no output message; the
    output layer and loss): the last stage, and on virtual stages only its last chunk; in a
    V, stage 0's chunk 1."""
    if getattr(cell, "v_shape", False):
        return stage == 0 and cell.chunk == 1
    return stage == num_stages - 1 and getattr(cell, "chunk", 0) == getattr(cell, "num_chunks", 1) - 1


def peer_cell(cell: Cell, direction: str, stage: int, num_stages: int) -> Cell:
    """The cell under which the receiver takes `cell`'s message in `direction` (F: to the
    next virtual stage, B: to the previous): `cell` itself, except across the ring of
    virtual stages, where the last rank's chunk c feeds the first rank's chunk c + 1 and the
    first rank's chunk c sends its gradient to the last rank's chunk c - 1. (A V's messages
    keep their chunk: its turn is no message, routes.py.)"""
    if type(cell) is not VirtualCell or cell.v_shape:
        return cell
    if direction == "F" and stage == num_stages - 1:
        return replace(cell, chunk=cell.chunk + 1)
    if direction == "B" and stage == 0:
        return replace(cell, chunk=cell.chunk - 1)
    return cell


@dataclass(frozen=True)
class Action:
    """A compute action (kind F, B or W) or a communication action (a key of COMM_KINDS).

    recv_cell: for the fused kinds, the cell whose message the call receives (`cell` is the
    one it sends)."""

    kind: ActionKind  # a kind's name ("F", "SEND_B", ...) is taken too
    cell: Cell
    recv_cell: Optional[Cell] = None

    def __post_init__(self) -> None:
        if type(self.kind) is not ActionKind:  # a name: checked here, once
            object.__setattr__(self, "kind", _kind(self.kind))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def operation(self) -> str:
        """F, B or W for compute actions; SEND, RECV, POST or SEND_RECV for communication."""
        return self.kind if self.is_compute else COMM_KINDS[self.kind][0]

    @property
    def direction(self) -> str:
        """The message's direction: F (activation, to the next stage) or B (gradient, to the
        previous stage); for a fused action, the direction it sends in."""
        return COMM_KINDS[self.kind][1]

    def __str__(self) -> str:
        return format_action(self)


def format_action(action: Action) -> str:
    """`F(m0b0t1)`, `SEND_F_RECV_B(m0b0t1, m0b0t0)`: the one spelling of an action (see the
    module docstring); `parse_action` reads it back."""
    if action.recv_cell is None:
        return f"{action.kind.value}({action.cell})"
    return f"{action.kind.value}({action.cell}, {action.recv_cell})"


_ACTION_TEXT = re.compile(r"^\s*([A-Za-z_]+)\(\s*([^,()\s]+)\s*(?:,\s*([^,()\s]+)\s*)?\)\s*$")
_FUSED_KINDS = ("SEND_F_RECV_B", "SEND_B_RECV_F")


def cells_by_name(cells: Iterable[Cell]) -> dict[str, Cell]:
    """The cells as `parse_action` looks them up: by their text (`m0b0t1`, `m0c1`)."""
    return {str(c): c for c in cells}


def parse_action(text: str, cells: Mapping[str, Cell]) -> Action:
    """The action `format_action` wrote as `text`; its cells are looked up in `cells` (by
    name, `cells_by_name`: a cell's rows and tokens come from the schedule's plan, not the
    text). Raises ValueError naming what does not parse."""
    match = _ACTION_TEXT.match(text)
    if match is None:
        raise ValueError(f"cannot read the action {text!r}: write KIND(CELL) as in F(m0b0t1), "
                         "or SEND_F_RECV_B(m0b0t1, m0b0t0) for a fused send-receive")
    name, cell_text, recv_text = match.groups()
    kind = _kind(name)
    if (recv_text is not None) != (kind in _FUSED_KINDS):
        raise ValueError(
            f"the action {text!r} names {2 if recv_text else 1} cell(s): the fused kinds "
            f"({', '.join(_FUSED_KINDS)}) name the cell they send and the one they receive, "
            "every other kind one cell")
    return Action(kind, _cell_named(cell_text, cells, text),
                  None if recv_text is None else _cell_named(recv_text, cells, text))


def _cell_named(name: str, cells: Mapping[str, Cell], text: str) -> Cell:
    cell = cells.get(name)
    if cell is None:
        known = list(cells)
        span = f"{known[0]} ... {known[-1]}" if known else "none"
        raise ValueError(f"the action {text!r} names the cell {name!r}, which the schedule's "
                         f"plan and batch shape do not have (its cells: {span})")
    return cell


@dataclass(frozen=True)
class TimedAction:
    """When a compute action ran on a stage, in seconds: predicted (the timing engines,
    timing.py) or measured (the runtime's RunRecord, on the rank's perf_counter clock)."""

    stage: int
    action: Action
    start: float
    end: float

    @property
    def kind(self) -> ActionKind:
        return self.action.kind

    @property
    def cell(self) -> Cell:
        return self.action.cell


def _kind(name: Union[str, ActionKind]) -> ActionKind:
    try:
        return ActionKind(name)
    except ValueError:
        raise ValueError(f"unknown action kind {name!r}: one of "
                         f"{', '.join(k.value for k in ActionKind)}") from None


_BY_OPERATION = {(operation, direction): kind for kind, (operation, direction) in COMM_KINDS.items()}


def send(direction: str, cell: Cell) -> Action:
    return Action(_BY_OPERATION["SEND", direction], cell)


def recv(direction: str, cell: Cell) -> Action:
    return Action(_BY_OPERATION["RECV", direction], cell)


def post(direction: str, cell: Cell) -> Action:
    """Post the receive of `cell`'s message before the compute that overlaps its transfer."""
    return Action(_BY_OPERATION["POST", direction], cell)


def send_recv(direction: str, cell: Cell, recv_cell: Cell) -> Action:
    return Action(ActionKind(f"SEND_{direction}_RECV_{opposite(direction)}"), cell, recv_cell)


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered compute actions. stages[k] is what pipeline stage k runs, in order."""

    plan: TeraPipePlan
    num_microbatches: int
    micro_batch_size: int
    forward_only: bool
    stages: tuple[tuple[Action, ...], ...]

    @property
    def defer_wgrad(self) -> bool:
        """True when weight gradients run as W actions (the plan defers them, and there is a
        backward)."""
        return self.plan.defer_wgrad and not self.forward_only

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_chunks(self) -> int:
        """Model chunks per stage (the plan's virtual_stages)."""
        return self.plan.virtual_stages

    def cells(self) -> list[Cell]:
        return microbatch_cells_all(self.plan, self.num_microbatches, self.micro_batch_size)


class ScheduleError(ValueError):
    """A schedule that breaks a dependency or would deadlock. `grid` (schedule/validate.py), when
    given, is the stage x step table with the failing step marked, printed under the message."""

    def __init__(self, message: str, grid: str = "") -> None:
        self.message, self.grid = message, grid
        super().__init__(f"{message}\n{grid}" if grid else message)


def microbatch_cells(plan: TeraPipePlan, microbatch: int, micro_batch_size: int,
                     chunk: Optional[int] = None,
                     num_microbatches: Optional[int] = None) -> list[Cell]:
    """Cells of one microbatch in forward order: batch slice by batch slice, tokens in order.
    `chunk`: the VirtualCells of that model chunk (plans with virtual stages).
    `num_microbatches`: of the iteration, which a plan with edge_slices needs."""
    if plan.edge_slices and num_microbatches is None:
        raise ValueError("a plan with edge_slices cuts microbatches by their place in the "
                         "iteration: give num_microbatches")
    slicing = plan.slices_of(microbatch, num_microbatches or 0)
    cells = []
    row = 0
    for b, (rows, token_slices) in enumerate(zip(plan.rows(micro_batch_size), slicing)):
        start = 0
        for t, length in enumerate(token_slices):
            if chunk is None:
                cells.append(Cell(microbatch, b, t, row, rows, start, length, len(token_slices)))
            else:
                cells.append(VirtualCell(microbatch, b, t, row, rows, start, length,
                                         len(token_slices), chunk, plan.virtual_stages,
                                         plan.virtual_placement == "v", plan.chunk_shares))
            start += length
        row += rows
    return cells


def microbatch_cells_all(plan: TeraPipePlan, num_microbatches: int, micro_batch_size: int) -> list[Cell]:
    """Every cell a stage runs: per microbatch, and with virtual stages per chunk (chunk-major
    within a microbatch)."""
    if plan.virtual_stages == 1:
        return [c for m in range(num_microbatches)
                for c in microbatch_cells(plan, m, micro_batch_size, None, num_microbatches)]
    return [c for m in range(num_microbatches) for chunk in range(plan.virtual_stages)
            for c in microbatch_cells(plan, m, micro_batch_size, chunk, num_microbatches)]
