"""Where a cell's messages go: the ranks of the virtual stages before and after it.

Without virtual stages a stage's neighbours are the stages before and after it. Round a ring of
model chunks (Megatron's placement) the last rank sends forward to the first rank's next chunk.
In a V (`VirtualCell.v_shape`) chunk 0 goes down the ranks and chunk 1 back up, and the last
rank's turn from chunk 0 to chunk 1 (and the gradient's from chunk 1 back to 0) stays on the
rank: no message, the rank's list runs the two in order.
"""

from __future__ import annotations

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
