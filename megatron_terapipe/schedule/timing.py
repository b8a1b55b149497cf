"""Timing engines: they replay the lowered action lists (lower.py) with given durations.

A compute action takes compute_time(stage, action). A SEND makes its message usable by the
neighbour transfer_time(stage, compute action) later; a stage never waits for its own sends.
A RECV waits for its message; a POST takes no time (it only lets a transfer start early).
Fused send-receive actions replay as their send, then their receive.
"""

from __future__ import annotations

from typing import Callable, Optional

from .actions import (COMM_KINDS, COMPUTE_KINDS, Action, Cell, Schedule, ScheduleError,
                      TimedAction, VirtualCell, format_action, opposite, peer_cell, recv)
from .routes import message_peer
from .lower import Lowering, lower

Lowered = tuple[tuple[Action, ...], ...]  # every stage's lowered list

Durations = Callable[[int, Action], float]
_EPS = 1e-12
# Step codes of the replay's compiled lists.
_COMPUTE, _SEND, _RECV = range(3)
_COMPUTE_KINDS = frozenset(COMPUTE_KINDS)


class _Replay:
    """The lowered lists compiled into steps, and where each stage is in its list.

    A step is (code, table, cell id, action, needs): a compute step adds its cell to `table`
    (the computations of its kind done on the stage) once `needs` (the same for the kind it
    depends on: a B its F, a W its B) holds it; a SEND writes its message's arrival time into
    the receiving stage's `table`; a RECV reads its own. POSTs take no time: left out."""

    def __init__(self, lowered: Lowered) -> None:
        self.num_stages = len(lowered)
        self.arrival = [{"F": {}, "B": {}} for _ in lowered]  # [stage][direction][cell id]
        self.computed = [{"F": set(), "B": set(), "W": set()} for _ in lowered]
        index: dict[Cell, int] = {}
        by_object: dict[int, int] = {}  # id(cell) -> cell id: schedules share their Cell objects
        self.steps = [self._compile(k, actions, index, by_object)
                      for k, actions in enumerate(lowered)]
        self.pos = [0] * self.num_stages

    def _compile(self, k: int, actions: tuple[Action, ...], index: dict[Cell, int],
                 by_object: dict[int, int]) -> list[tuple]:
        done, arrival = self.computed[k], self.arrival
        needs = {"F": None, "B": done["F"], "W": done["B"]}
        steps: list[tuple] = []
        computed = None  # the last compute action: the one a send that follows it sends for
        for a in actions:
            cid = by_object.get(id(a.cell))
            if cid is None:
                cid = by_object[id(a.cell)] = index.setdefault(a.cell, len(index))
            if a.kind in _COMPUTE_KINDS:
                steps.append((_COMPUTE, done[a.kind], cid, a, needs[a.kind]))
                computed = a
                continue
            operation, direction = COMM_KINDS[a.kind]
            if operation == "RECV":
                steps.append((_RECV, arrival[k][direction], cid, a, None))
            elif operation != "POST":  # a send, with the compute action it asks a transfer time for
                # the next (F) or previous (B) virtual stage's rank (round the ring of an
                # interleaved schedule's chunks; back up the ranks on a V's chunk 1)
                to = message_peer(a.cell, direction, k, self.num_stages)
                sent = (computed if computed is not None and computed.cell is a.cell
                        and computed.kind == direction else Action(direction, a.cell))
                if type(a.cell) is VirtualCell:  # the receiver names its own cell (lower.py)
                    cid = index.setdefault(peer_cell(a.cell, direction, k, self.num_stages),
                                           len(index))
                steps.append((_SEND, arrival[to][direction], cid, sent, None))
            if a.recv_cell is not None:  # fused: then its receive
                back = opposite(direction)
                rid = index.setdefault(a.recv_cell, len(index))
                steps.append((_RECV, arrival[k][back], rid, recv(back, a.recv_cell), None))
        return steps

    def next(self, k: int) -> Optional[tuple]:
        steps = self.steps[k]
        return steps[self.pos[k]] if self.pos[k] < len(steps) else None

    def done(self) -> bool:
        return all(p == len(steps) for p, steps in zip(self.pos, self.steps))

    def deadlock(self) -> None:
        stuck = {k: format_action(self.next(k)[3]) for k in range(self.num_stages) if self.next(k)}
        raise ScheduleError(f"schedule deadlocks: stages wait at {stuck}")


def timeline(schedule: Schedule, compute_time: Durations,
             transfer_time: Durations = lambda stage, action: 0.0,
             lowering: Lowering = Lowering()) -> list[TimedAction]:
    """Every compute action's start and end when each stage runs its lowered list as soon as
    its messages allow (list scheduling). Raises ScheduleError on a deadlock. The lowering
    choices do not change the times (posts take none; fused calls replay as their parts)."""
    return replay_timeline(_lowered(schedule, lowering), compute_time, transfer_time)


def _lowered(schedule: Schedule, lowering: Lowering) -> Lowered:
    """The schedule's lowered lists: its own where it lays out its messages itself (the
    interleaved schedule, interleaved.py), else `lower`'s."""
    own = getattr(schedule, "lowered", None)
    return own(lowering) if own is not None else lower(schedule, lowering)


def replay_timeline(lowered: Lowered, compute_time: Durations,
                    transfer_time: Durations = lambda stage, action: 0.0) -> list[TimedAction]:
    """`timeline` of lists already lowered."""
    replay = _Replay(lowered)
    out: list[TimedAction] = []
    free_at = [0.0] * replay.num_stages
    while not replay.done():
        progressed = False
        for k, steps in enumerate(replay.steps):
            pos, now = replay.pos[k], free_at[k]
            while pos < len(steps):
                code, table, cid, action, needs = steps[pos]
                if code == _COMPUTE:
                    if needs is not None and cid not in needs:
                        break
                    end = now + compute_time(k, action)
                    out.append(TimedAction(k, action, now, end))
                    table.add(cid)
                    now = end
                elif code == _SEND:
                    table[cid] = now + transfer_time(k, action)
                else:
                    ready = table.get(cid)
                    if ready is None:
                        break
                    now = max(now, ready)
                pos += 1
            progressed = progressed or pos != replay.pos[k]
            replay.pos[k], free_at[k] = pos, now
        if not progressed:
            replay.deadlock()
    return out


def shared_timeline(schedule: Schedule, compute_time: Durations,
                    transfer_time: Durations = lambda stage, action: 0.0,
                    cores: float = 1.0, lowering: Lowering = Lowering()) -> list[TimedAction]:
    """Like `timeline`, for stages that share `cores` processors (processor sharing).

    When n stages compute at once, each runs at min(1, cores / n) of its own speed: e.g. a
    2-stage CPU run on a machine whose processes really share one core. compute_time is the
    action's duration when it runs alone.
    """
    if cores <= 0:
        raise ValueError(f"cores must be positive, got {cores}")
    replay = _Replay(_lowered(schedule, lowering))
    running: dict[int, list] = {}  # stage -> [step, start, remaining seconds of solo work]
    out: list[TimedAction] = []
    now = 0.0
    while True:
        wake = _start_ready_stages(replay, running, now, compute_time, transfer_time)
        if not running:
            if wake == float("inf"):
                if not replay.done():
                    replay.deadlock()
                return out
            now = wake
            continue
        rate = min(1.0, cores / len(running))
        step = min(min(r[2] for r in running.values()) / rate, wake - now)
        now += step
        for k in list(running):
            entry = running[k]
            entry[2] -= step * rate
            if entry[2] <= _EPS:
                _, table, cid, action, _ = entry[0]
                out.append(TimedAction(k, action, entry[1], now))
                table.add(cid)
                replay.pos[k] += 1
                del running[k]


def _start_ready_stages(replay: _Replay, running: dict[int, list], now: float,
                        compute_time: Durations, transfer_time: Durations) -> float:
    """Run idle stages' communication due by `now` and start their next computations.
    Returns the earliest later arrival an idle stage waits for (inf: none)."""
    wake = float("inf")
    progressed = True
    while progressed:  # a send can free a stage scanned before it
        progressed = False
        for k in range(replay.num_stages):
            if k in running:
                continue
            while (step := replay.next(k)) is not None and step[0] != _COMPUTE:
                code, table, cid, action, _ = step
                if code == _SEND:
                    table[cid] = now + transfer_time(k, action)
                else:
                    ready = table.get(cid)
                    if ready is None or ready > now + _EPS:
                        wake = wake if ready is None else min(wake, ready)
                        break
                replay.pos[k] += 1
                progressed = True
            if step is not None and step[0] == _COMPUTE and (step[4] is None or step[2] in step[4]):
                running[k] = [step, now, compute_time(k, step[3])]
    return wake
