"""What a schedule is made of: cells, the actions stages run on them, and the schedule itself.

A cell is (microbatch, batch slice, token slice). A schedule gives every stage its ordered
compute actions: forward (F), backward (B) and, when the plan defers weight gradients, W.
Lowering (lower.py) adds the communication actions that move activations (direction "F", to
the next stage) and gradients (direction "B", to the previous stage) between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Union

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
        cells = f"{self.cell}, {self.recv_cell}" if self.recv_cell is not None else f"{self.cell}"
        return f"{self.kind}({cells})"


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

    def cells(self) -> list[Cell]:
        return microbatch_cells_all(self.plan, self.num_microbatches, self.micro_batch_size)


class ScheduleError(ValueError):
    """A schedule that breaks a dependency or would deadlock. `grid` (schedule/grid.py), when
    given, is the stage x step table with the failing step marked, printed under the message."""

    def __init__(self, message: str, grid: str = "") -> None:
        self.message, self.grid = message, grid
        super().__init__(f"{message}\n{grid}" if grid else message)


def microbatch_cells(plan: TeraPipePlan, microbatch: int, micro_batch_size: int) -> list[Cell]:
    """Cells of one microbatch in forward order: batch slice by batch slice, tokens in order."""
    cells = []
    row = 0
    for b, (rows, token_slices) in enumerate(zip(plan.rows(micro_batch_size), plan.token_slices)):
        start = 0
        for t, length in enumerate(token_slices):
            cells.append(Cell(microbatch, b, t, row, rows, start, length, len(token_slices)))
            start += length
        row += rows
    return cells


def microbatch_cells_all(plan: TeraPipePlan, num_microbatches: int, micro_batch_size: int) -> list[Cell]:
    return [c for m in range(num_microbatches) for c in microbatch_cells(plan, m, micro_batch_size)]
