"""Lowering: one pass that adds the communication actions between a stage's compute actions.

As torch.distributed.pipelining's `_add_send_recv`: a forward that is not on the first stage
receives its input first (RECV_F), a forward that is not on the last stage sends its output
after (SEND_F), and a backward does the same the other way (RECV_B / SEND_B). The executor and
the timing engines (replay.py) run the lowered lists. Two choices depend on the transport:

- post_receives_early (gloo): gloo moves a message only once its receive is posted, so before
  every F or B, the receive of the stage's next input and of its next gradient is posted
  (POST_F / POST_B, at most one per direction at a time) and the transfer overlaps the
  compute; the RECV where the data is used then completes it.
- fuse_send_recv (Megatron's P2PCommunicator): its blocking calls need a send and the receive
  right after it in one call, as Megatron's 1F1B does: SEND_F followed by the next action's
  RECV_B becomes SEND_F_RECV_B (and SEND_B + RECV_F becomes SEND_B_RECV_F).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .actions import Action, Cell, Schedule, opposite, post, recv, send, send_recv


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
    # Which compute kinds get their input from a neighbour (F: an activation, B: a gradient),
    # and which send their result to one.
    receives = {"F": stage > 0, "B": stage < schedule.num_stages - 1}
    sends = {"F": receives["B"], "B": receives["F"]}
    upcoming = _next_cells(actions) if lowering.post_receives_early else None
    posted: dict[str, Optional[Cell]] = {"F": None, "B": None}
    received_by_fused = -1  # position of the action whose input a fused call received
    out: list[Action] = []
    for i, action in enumerate(actions):
        kind = action.kind
        if kind != "W" and receives[kind]:
            if i != received_by_fused:
                out.append(_made(made, recv, kind, action.cell))
            posted[kind] = None
        if kind != "W" and upcoming is not None:
            for direction in ("F", "B"):
                cell = upcoming[direction][i]
                if receives[direction] and cell is not None and posted[direction] is None:
                    out.append(post(direction, cell))
                    posted[direction] = cell
        out.append(action)
        if kind == "W" or not sends[kind]:
            continue
        following = actions[i + 1] if i + 1 < len(actions) else None
        if lowering.fuse_send_recv and following is not None and following.kind == opposite(kind):
            out.append(send_recv(kind, action.cell, following.cell))
            received_by_fused = i + 1
            posted[following.kind] = None
        else:
            out.append(_made(made, send, kind, action.cell))
    return tuple(out)


def _next_cells(actions: tuple[Action, ...]) -> dict[str, list[Optional[Cell]]]:
    """For each kind (F, B) and position, the cell of the next action of that kind after it."""
    upcoming: dict[str, list[Optional[Cell]]] = {"F": [None] * len(actions),
                                                 "B": [None] * len(actions)}
    following: dict[str, Optional[Cell]] = {"F": None, "B": None}
    for i in range(len(actions) - 1, -1, -1):
        upcoming["F"][i], upcoming["B"][i] = following["F"], following["B"]
        if actions[i].kind in following:
            following[actions[i].kind] = actions[i].cell
    return upcoming
