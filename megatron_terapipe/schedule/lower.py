"""Lowering: one pass that adds the communication actions between a stage's compute actions.

As torch.distributed.pipelining's `_add_send_recv`: a forward that is not on the first stage
receives its input first (RECV_F), a forward that is not on the last stage sends its output
after (SEND_F), and a backward does the same the other way (RECV_B / SEND_B). The executor and
the timing engines (timing.py) run the lowered lists. Two choices depend on the transport:

- post_receives_early (gloo): gloo moves a message only once its receive is posted, so before
  every F or B, the receive of the stage's next input and of its next gradient is posted
  (POST_F / POST_B, at most one per direction at a time) and the transfer overlaps the
  compute; the RECV where the data is used then completes it.
- fuse_send_recv (Megatron's P2PCommunicator): its blocking calls need a send and the receive
  right after it in one call, as Megatron's 1F1B does: SEND_F followed by the next action's
  RECV_B becomes SEND_F_RECV_B (and SEND_B + RECV_F becomes SEND_B_RECV_F).

Virtual stages (VirtualCell): what receives and sends is the virtual stage, not the rank. A
forward receives unless it runs the model's first layers (rank 0, chunk 0) and sends unless
it runs the last ones (the last rank, last chunk); backwards the other way. Messages go round
a ring: rank k sends forward to rank (k + 1) % K and backward to (k - 1) % K. Each side names
its own cell: the last rank's SEND_F(m0b0t0c0) arrives as the first rank's RECV_F(m0b0t0c1)
(`actions.peer_cell`). In a V (`VirtualCell.v_shape`) chunk 1 sends forward to the previous
rank (`placement.message_peer`), and the last rank's turn from chunk 0 to chunk 1 is no message:
its list runs the two in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .actions import (Action, Cell, Schedule, first_virtual_stage, last_virtual_stage, opposite,
                      post, recv, send, send_recv)
from .routes import hands_over_locally, takes_over_locally


@dataclass(frozen=True)
class Lowering:
    """How a transport wants its communication laid out (see the module docstring)."""

    post_receives_early: bool = False
    fuse_send_recv: bool = False


def lower(schedule: Schedule, lowering: Lowering = Lowering()) -> tuple[tuple[Action, ...], ...]:
    """Every stage's compute actions with their communication actions in place."""
    made: dict = {}
    return tuple(lower_stage(schedule, k, lowering, made) for k in range(schedule.num_stages))


def _made(made: dict, make, direction: str, cell: Cell) -> Action:
    """One communication action per (kind, direction, cell), shared by the stages."""
    key = (make, direction, id(cell))
    action = made.get(key)
    if action is None:
        action = made[key] = make(direction, cell)
    return action


def lower_stage(schedule: Schedule, stage: int, lowering: Lowering = Lowering(),
                made: Optional[dict] = None) -> tuple[Action, ...]:
    """One stage's lowered action list. `made`: communication actions other stages made
    (the schedule's cells are alive as long as it is, so their ids name them)."""
    made = {} if made is None else made
    actions = schedule.stages[stage]
    receives, sends = message_ends(schedule, stage)
    upcoming = _next_cells(actions, receives) if lowering.post_receives_early else None
    posted: dict[str, Optional[Cell]] = {"F": None, "B": None}
    received_by_fused = -1  # position of the action whose input a fused call received
    out: list[Action] = []
    for i, action in enumerate(actions):
        kind = action.kind
        if kind != "W" and receives(action):
            if i != received_by_fused:
                out.append(_made(made, recv, kind, action.cell))
            posted[kind] = None
        if kind != "W" and upcoming is not None:
            for direction in ("F", "B"):
                cell = upcoming[direction][i]
                if cell is not None and posted[direction] is None:
                    out.append(post(direction, cell))
                    posted[direction] = cell
        out.append(action)
        # a forward sends unless it runs the last layers; a backward unless the first
        if kind == "W" or not sends(action):
            continue
        following = actions[i + 1] if i + 1 < len(actions) else None
        if (lowering.fuse_send_recv and following is not None
                and following.kind == opposite(kind) and receives(following)):
            out.append(send_recv(kind, action.cell, following.cell))
            received_by_fused = i + 1
            posted[following.kind] = None
        else:
            out.append(_made(made, send, kind, action.cell))
    return tuple(out)


def message_ends(schedule: Schedule, stage: int) -> tuple[Callable[[Action], bool],
                                                   Callable[[Action], bool]]:
    """(whether an F or B action receives its input from a neighbour, whether it sends its
    result to one). Without virtual stages the rank decides (one answer per kind); with them
    the virtual stage: a forward receives unless it runs the model's first layers and sends
    unless its last ones, a backward the other way round."""
    K = schedule.num_stages
    if schedule.plan.virtual_stages == 1:
        r = {"F": stage > 0, "B": stage < K - 1}
        s = {"F": r["B"], "B": r["F"]}
        return (lambda a: r[a.kind]), (lambda a: s[a.kind])

    def first(a: Action) -> bool:
        return first_virtual_stage(a.cell, stage)

    def last(a: Action) -> bool:
        return last_virtual_stage(a.cell, stage, K)

    # a V's turn hands a cell from chunk 0 to chunk 1 (and its gradient back) within the rank
    return ((lambda a: not ((first(a) if a.kind == "F" else last(a))
                            or takes_over_locally(a.cell, a.kind, stage, K))),
            (lambda a: not ((last(a) if a.kind == "F" else first(a))
                            or hands_over_locally(a.cell, a.kind, stage, K))))


def _next_cells(actions: tuple[Action, ...],
                receives: Callable[[Action], bool]) -> dict[str, list[Optional[Cell]]]:
    """For each kind (F, B) and position, the cell of the next action of that kind after it
    that receives a message (None: none)."""
    upcoming: dict[str, list[Optional[Cell]]] = {"F": [None] * len(actions),
                                                 "B": [None] * len(actions)}
    following: dict[str, Optional[Cell]] = {"F": None, "B": None}
    for i in range(len(actions) - 1, -1, -1):
        upcoming["F"][i], upcoming["B"][i] = following["F"], following["B"]
        if actions[i].kind in following and receives(actions[i]):
            following[actions[i].kind] = actions[i].cell
    return upcoming
