"""Where a cell's messages go: the ranks of the virtual stages before and after it.

Without virtual stages a stage's neighbours are the stages before and after it. Round a ring of
model chunks (Megatron's placement) the last rank sends forward to the first rank's next chunk.
In a V (`VirtualCell.v_shape`) chunk 0 goes down the ranks and chunk 1 back up, and the last
rank's turn from chunk 0 to chunk 1 (and the gradient's from chunk 1 back to 0) stays on the
rank: no message, the rank's list runs the two in order.
"""

from __future__ import annotations

from dataclasses import replace

from .actions import Cell, opposite


def hands_over_locally(cell: Cell, direction: str, stage: int, num_stages: int) -> bool:
    """Whether `cell`'s message in `direction` from `stage` stays on the rank: the turn of a V
    (the last rank's chunk 0 feeds its own chunk 1, whose gradient feeds chunk 0 back)."""
    return (getattr(cell, "v_shape", False) and stage == num_stages - 1
            and cell.chunk == (0 if direction == "F" else 1))


def takes_over_locally(cell: Cell, direction: str, stage: int, num_stages: int) -> bool:
    """Whether `cell`'s input in `direction` (F: its activation, B: its output gradient) on
    `stage` comes from the rank itself: the other side of `hands_over_locally`."""
    return (getattr(cell, "v_shape", False) and stage == num_stages - 1
            and cell.chunk == (1 if direction == "F" else 0))


def message_peer(cell: Cell, direction: str, stage: int, num_stages: int) -> int:
    """The rank that receives `cell`'s message in `direction` (F: to the next virtual stage,
    B: to the previous) from `stage`: the neighbour, round the ring on virtual stages (and
    Megatron's interleaved chunks); in a V, chunk 0 sends forward to the next rank and chunk 1
    to the previous (the turn: the rank itself, `hands_over_locally`)."""
    step = 1 if direction == "F" else -1
    if getattr(cell, "v_shape", False):
        if hands_over_locally(cell, direction, stage, num_stages):
            return stage
        return stage + (step if cell.chunk == 0 else -step)
    return (stage + step) % num_stages


def message_source(cell: Cell, direction: str, stage: int, num_stages: int) -> int:
    """The rank `cell`'s message in `direction` comes from, received on `stage`: where the
    opposite message from `stage` goes (virtual stages are a path, walked both ways)."""
    return message_peer(cell, opposite(direction), stage, num_stages)


#: The routes a V's chunk 1 sends on: back up the ranks forward, down them backward.
V_RETURN_ROUTES = {"F": "F-up", "B": "B-down"}
#: Each route's opposite: where the answer to a message on it comes back (its gradient, or the
#: activation it is the gradient of).
OPPOSITE_ROUTES = {"F": "B", "B": "F", "F-up": "B-down", "B-down": "F-up"}


def message_route(cell: Cell, direction: str) -> str:
    """The route of `cell`'s message in `direction`, which a transport keeps apart from the
    others (its own tag on gloo): "F" to the next rank, "B" to the previous (round the ring
    too); in a V, chunk 1 runs the other way: "F-up" to the previous rank, "B-down" to the
    next. Between two ranks each route carries one (from, to, direction) of the validation's
    (validate.py), so it matches messages in the order the validation checked."""
    if getattr(cell, "v_shape", False) and cell.chunk == 1:
        return V_RETURN_ROUTES[direction]
    return direction


def turned_cell(cell: Cell) -> Cell:
    """The cell on the other chunk of a V's turn (the last rank hands chunk 0's output to
    chunk 1, and chunk 1's input gradient back to chunk 0)."""
    return replace(cell, chunk=1 - cell.chunk)


def loss_stage(plan, num_stages: int) -> int:
    """The pipeline rank that runs `plan`'s loss and reports its losses: the last, or in a V
    (virtual_placement "v") rank 0, as `actions.last_virtual_stage` says per cell."""
    return 0 if plan.virtual_placement == "v" else num_stages - 1
