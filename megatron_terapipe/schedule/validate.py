"""`validate`: the rules the executor relies on, checked before anything runs.

Dependencies (what the executor relies on, and what the timing engines model):
- F(c) on stage k needs F(c) on stage k-1 (its input activation).
- B(c) on stage k needs B(c) on stage k+1 (its output gradient) and F(c) on stage k.
- W(c) (c: a sequence's first token slice, or an early W point) needs B(c) on the same stage;
  nothing waits for it.
- Token slices of one (microbatch, batch slice) go forward in order and backward in reverse,
  because slice t reads the K/V of slices < t, and their K/V gradients arrive from later slices.
Virtual stages (VirtualCell): the same per virtual stage. F(c) of virtual stage s needs F(c)
of s - 1 (on rank (s - 1) % K, the previous chunk across the ring; in a V, chunk 1 of rank k
follows chunk 1 of rank k + 1, and the last rank's chunk 1 its own chunk 0, run before it in
its list), B(c) needs B(c) of s + 1; slice order, the K/V and the W actions are per
(sequence, chunk): its sequence key.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from .actions import (
    Action,
    Cell,
    Schedule,
    ScheduleError,
    format_action,
    opposite,
    peer_cell,
)
from .lower import Lowering, lower
from .routes import message_peer, message_source, takes_over_locally
from .timing import Lowered, replay_timeline


def validate(schedule: Schedule, lowering: Lowering = Lowering()) -> Lowered:
    """Check every stage runs each cell's F (and B) once, in an order the executor can run,
    that the lowered lists pair every send with the neighbour's receive, and that the
    schedule does not deadlock. Raises ScheduleError naming the first broken rule, with the
    stage x step grid (the failing step marked where there is one). Returns the lowered lists
    it checked (build.py keeps them for the executor)."""
    expected = set(schedule.cells())
    for k, actions in enumerate(schedule.stages):
        _check_stage(schedule, k, actions, expected)
    lowered = lower(schedule, lowering)
    _check_messages(lowered)
    try:
        replay_timeline(lowered, lambda k, a: 1.0)
    except ScheduleError as exc:
        raise ScheduleError(exc.message, format_grid(schedule.stages)) from None
    return lowered


class _StageState:
    """What a stage has run so far, as its list is checked in order."""

    def __init__(self) -> None:
        self.seen: dict[str, set[Cell]] = {"F": set(), "B": set()}
        # Per sequence, the token slice that ran last: forwards count up, backwards down.
        self.last: dict[str, dict] = {"F": {}, "B": {}}
        self.final_w: set[tuple[int, int]] = set()  # sequences whose last W (first slice) ran
        self.early_w: set[Cell] = set()


def _check_stage(schedule: Schedule, k: int, actions: tuple[Action, ...],
                 expected: set[Cell]) -> None:
    state = _StageState()
    for step, a in enumerate(actions):
        try:
            _check_action(schedule, k, a, state)
        except ScheduleError as exc:  # the rule's message, then the grid marked at this step
            raise ScheduleError(exc.message, format_grid(schedule.stages, (k, step))) from None
    problem = _stage_totals(schedule, k, state, expected)
    if problem:
        raise ScheduleError(problem, format_grid(schedule.stages))


def _check_action(schedule: Schedule, k: int, a: Action, state: _StageState) -> None:
    c, seen, last = a.cell, state.seen, state.last
    if a.kind == "W":
        _check_w(schedule, k, a, seen["B"], state.final_w, state.early_w)
        return
    if c in seen[a.kind]:
        raise ScheduleError(f"stage {k} runs {a} twice")
    if a.kind == "F" and c.token_slice != last["F"].get(c.sequence_key, -1) + 1:
        raise ScheduleError(f"stage {k} runs {a} before the token slices before it")
    if takes_over_locally(c, a.kind, k, schedule.num_stages):
        given = replace(c, chunk=1 - c.chunk)  # the turn's other chunk
        if given not in seen[a.kind]:
            raise ScheduleError(f"stage {k} runs {a} before {a.kind}({given}), whose "
                                f"{'output' if a.kind == 'F' else 'input gradient'} it takes")
    if a.kind == "B":
        if c not in seen["F"]:
            raise ScheduleError(f"stage {k} runs {a} before its forward")
        if c.token_slice != last["B"].get(c.sequence_key, c.num_token_slices) - 1:
            raise ScheduleError(
                f"stage {k} runs {a} out of reverse token order (K/V gradients from later "
                "slices must be complete first)")
    last[a.kind][c.sequence_key] = c.token_slice
    seen[a.kind].add(c)


def _stage_totals(schedule: Schedule, k: int, state: _StageState, expected: set[Cell]) -> str:
    seen = state.seen
    if seen["F"] != expected:
        return f"stage {k} runs {len(seen['F'])} forwards, expected {len(expected)}"
    if not schedule.forward_only and seen["B"] != expected:
        return f"stage {k} runs {len(seen['B'])} backwards, expected {len(expected)}"
    if schedule.forward_only and seen["B"]:
        return f"stage {k} runs backwards in a forward-only schedule"
    if schedule.defer_wgrad and len(state.final_w) != len({c.sequence_key for c in expected}):
        return (f"stage {k} runs {len(state.final_w)} final weight-gradient (W) actions "
                "(after a sequence's first token slice), expected one per sequence")
    return ""


def _check_w(schedule: Schedule, k: int, a: Action, backwards_seen: set[Cell],
             final_w: set[tuple[int, int]], early_w: set[Cell]) -> None:
    if not schedule.defer_wgrad:
        raise ScheduleError(f"stage {k} runs {a} but the plan computes weight "
                            "gradients in every backward (defer_wgrad=False)")
    if a.cell not in backwards_seen:
        raise ScheduleError(f"stage {k} runs {a} before the backward of its cell")
    if a.cell.sequence_key in final_w or a.cell in early_w:
        raise ScheduleError(f"stage {k} runs {a} twice")
    if a.cell.is_first_token_slice:
        final_w.add(a.cell.sequence_key)
    else:
        early_w.add(a.cell)


def _check_messages(lowered: tuple[tuple[Action, ...], ...]) -> None:
    """Each direction between two ranks carries its messages in one order on both sides
    (transports match them in order), and a posted receive is used before the next is posted.
    Where a message goes and comes from is the virtual stages' (`message_peer`: neighbours,
    round the ring of chunks, or down and back up a V), and each side names it by its own
    cell (`peer_cell`)."""
    K = len(lowered)
    sent: dict[tuple[int, int, str], list[Cell]] = {}  # (from, to, direction) -> cells
    received: dict[tuple[int, int, str], list[Cell]] = {}
    for k, actions in enumerate(lowered):
        posted = {"F": None, "B": None}
        for step, a in enumerate(actions):
            if a.is_compute:
                continue
            if a.operation in ("SEND", "SEND_RECV"):
                to = message_peer(a.cell, a.direction, k, K)
                sent.setdefault((k, to, a.direction), []).append(
                    peer_cell(a.cell, a.direction, k, K))
            if a.operation in ("RECV", "SEND_RECV"):
                used, cell = ((a.direction, a.cell) if a.operation == "RECV"
                              else (opposite(a.direction), a.recv_cell))
                source = message_source(cell, used, k, K)
                received.setdefault((source, k, used), []).append(cell)
            if a.operation == "POST":
                if posted[a.direction] is not None:
                    raise ScheduleError(f"stage {k} posts {a} before using {posted[a.direction]}",
                                        format_grid(lowered, (k, step)))
                posted[a.direction] = a.cell
            if a.operation in ("RECV", "SEND_RECV"):
                if posted[used] not in (None, cell):
                    raise ScheduleError(f"stage {k} runs {a} while the receive of "
                                        f"{posted[used]} is posted", format_grid(lowered, (k, step)))
                posted[used] = None
    for key in sorted(set(sent) | set(received)):
        if sent.get(key, []) != received.get(key, []):
            raise ScheduleError(f"stages {key[0]} and {key[1]} send and receive in different "
                                f"orders ({key[2]} messages)", format_grid(lowered))


# The stage x step grid of a schedule as text, for errors and logs.
#
# Like torch.distributed.pipelining's pipeline-order table: one column per stage, one row per
# step (the position in that stage's list), with the step a check failed on marked.

MARK_LEFT, MARK_RIGHT = ">>", "<<"
CONTEXT_STEPS = 6  # rows shown on each side of a marked step
UNMARKED_STEPS = 24  # rows shown from the top when no step is marked


def format_grid(stages: Sequence[Sequence[Action]], mark: Optional[tuple[int, int]] = None) -> str:
    """Rows `step NN | stage 0 action | stage 1 action ...`; `mark` = (stage, step) is shown as
    `>>F(m0b0t1)<<` and its row ends with `<- here`. Long lists show the rows around the mark
    (or the first rows) and say how many were left out."""
    steps = max((len(actions) for actions in stages), default=0)
    if mark is not None:
        first, last = max(0, mark[1] - CONTEXT_STEPS), min(steps, mark[1] + CONTEXT_STEPS + 1)
    else:
        first, last = 0, min(steps, UNMARKED_STEPS)
    cells = [[_cell(stages, k, step, mark) for k in range(len(stages))]
             for step in range(first, last)]
    width = max([len(f"stage {k}") for k in range(len(stages))] +
                [len(text) for row in cells for text in row] + [1])
    lines = ["step | " + " | ".join(f"stage {k}".ljust(width) for k in range(len(stages))).rstrip()]
    if first > 0:
        lines.append(f"  ... {first} earlier steps")
    for step, row in zip(range(first, last), cells):
        here = "  <- here" if mark is not None and step == mark[1] else ""
        lines.append(f"{step:4d} | " + " | ".join(t.ljust(width) for t in row).rstrip() + here)
    if last < steps:
        lines.append(f"  ... {steps - last} later steps")
    return "\n".join(lines)


def _cell(stages: Sequence[Sequence[Action]], k: int, step: int,
          mark: Optional[tuple[int, int]]) -> str:
    if step >= len(stages[k]):
        return ""
    text = format_action(stages[k][step])
    return f"{MARK_LEFT}{text}{MARK_RIGHT}" if mark == (k, step) else text
