"""The one schedule representation: per-stage ordered forward/backward actions on cells.

A cell is (microbatch, batch slice, token slice). Every stage runs the same cells; a schedule
says in which order each stage runs their forwards (F) and backwards (B), and, when the plan
defers weight gradients, one W per sequence: the weight gradients of all its token slices in one
go, right after the backward of its first slice. The executor runs a stage's list as it stands;
the simulator times the same lists; `validate` checks them.

Dependencies (what the executor relies on, and what the timing engine models):
- F(c) on stage k needs F(c) on stage k-1 (its input activation).
- B(c) on stage k needs B(c) on stage k+1 (its output gradient) and F(c) on stage k.
- W(c) (c: a sequence's first token slice) needs B(c) on the same stage; nothing waits for it.
- Token slices of one (microbatch, batch slice) go forward in order and backward in reverse,
  because slice t reads the K/V of slices < t, and their K/V gradients arrive from later slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Optional

from .plan import TeraPipePlan

Kind = Literal["F", "B", "W"]


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
    kind: Kind
    cell: Cell

    def __str__(self) -> str:
        return f"{self.kind}({self.cell})"


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered actions. stages[k] is what pipeline stage k runs, in order."""

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
    """A schedule that breaks a dependency or would deadlock."""


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


def build_schedule(plan: TeraPipePlan, num_microbatches: int, num_stages: int,
                   micro_batch_size: int, forward_only: bool = False) -> Schedule:
    """Lay out every stage's actions in the plan's order.

    gpipe: all forwards in cell order, then all backwards in exactly reverse order.
    1f1b:  stage k first runs (cells of one microbatch - 1) + (num_stages - k - 1) forwards,
           then alternates one forward and one backward, then drains the backwards. Backwards
           go microbatch by microbatch, each microbatch's cells in reverse. Because the warm-up
           covers a whole microbatch, the last stage knows a microbatch's total token count
           before it runs the first backward of that microbatch (exact loss normalisation).
    """
    if num_microbatches <= 0:
        raise ValueError(f"num_microbatches must be positive, got {num_microbatches}")
    if num_stages <= 0:
        raise ValueError(f"number of pipeline stages must be positive, got {num_stages}")
    if plan.batch_slices is not None:
        plan.validate(plan.seq_length, micro_batch_size)
    if len(plan.wgrad_points) > num_stages:
        raise ValueError(
            f"the TeraPipe plan places early W actions (wgrad_points) for "
            f"{len(plan.wgrad_points)} pipeline stages but the pipeline has {num_stages}: plan "
            f"for {num_stages} stages (terapipe-plan --pipeline-stages {num_stages})")
    per_mb = [microbatch_cells(plan, m, micro_batch_size) for m in range(num_microbatches)]
    forwards = [Action("F", c) for cells in per_mb for c in cells]
    stages = []
    for k in range(num_stages):
        if forward_only:
            stages.append(tuple(forwards))
            continue
        if plan.order == "gpipe":
            backwards = [Action("B", a.cell) for a in reversed(forwards)]
            stages.append(tuple(forwards + _with_weight_grads(backwards, plan, k)))
            continue
        backwards = [Action("B", c) for cells in per_mb for c in reversed(cells)]
        n = len(forwards)
        warmup = min(n, len(per_mb[0]) - 1 + (num_stages - k - 1))
        order = list(forwards[:warmup])
        f, b = warmup, 0
        while f < n:
            order.append(forwards[f])
            f += 1
            order.append(backwards[b])
            b += 1
        order.extend(backwards[b:])
        stages.append(tuple(_with_weight_grads(order, plan, k)))
    return Schedule(plan, num_microbatches, micro_batch_size, forward_only, tuple(stages))


def _with_weight_grads(actions: list[Action], plan: TeraPipePlan, stage: int) -> list[Action]:
    """A W right after each sequence's last backward (that of its first token slice), and after
    the backward of the stage's `wgrad_points` slices. A W computes every weight gradient its
    sequence deferred since the previous W."""
    if not plan.defer_wgrad:
        return actions
    early = set(plan.wgrad_points_of(stage))
    out = []
    for a in actions:
        out.append(a)
        if a.kind == "B" and (a.cell.is_first_token_slice or a.cell.token_slice in early):
            out.append(Action("W", a.cell))
    return out


@dataclass(frozen=True)
class TimedAction:
    stage: int
    action: Action
    start: float
    end: float


def timeline(schedule: Schedule,
             compute_time: Callable[[int, Action], float],
             transfer_time: Callable[[int, Action], float] = lambda stage, action: 0.0,
             ) -> list[TimedAction]:
    """Run the schedule's dependency graph with the given durations (list scheduling).

    compute_time(stage, action) is the action's duration on that stage; transfer_time(stage,
    action) the delay between the action finishing on `stage` and its result being usable by the
    neighbour (forward: stage+1, backward: stage-1). Sends are asynchronous: a stage never waits
    for its own send. Raises ScheduleError on a deadlock.
    """
    deps = _Dependencies(schedule, transfer_time)
    K = schedule.num_stages
    pos = [0] * K
    out: list[TimedAction] = []
    remaining = sum(len(s) for s in schedule.stages)
    while remaining:
        progressed = False
        for k in range(K):
            actions = schedule.stages[k]
            while pos[k] < len(actions):
                action = actions[pos[k]]
                start = deps.ready_time(k, action)
                if start is None:
                    break
                end = start + compute_time(k, action)
                deps.done(k, action, end)
                out.append(TimedAction(k, action, start, end))
                pos[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            deps.deadlock(pos)
    return out


class _Dependencies:
    """When each stage's next action may start: its own previous action and the neighbour
    results it needs (module docstring), with transfer delays. Cells are integer ids."""

    def __init__(self, schedule: Schedule,
                 transfer_time: Callable[[int, Action], float]) -> None:
        self.schedule = schedule
        self.transfer_time = transfer_time
        self.K = K = schedule.num_stages
        self.index: dict[Cell, int] = {}
        for actions in schedule.stages:
            for a in actions:
                self.index.setdefault(a.cell, len(self.index))
        n = len(self.index)
        # finish_*[stage][cell id]: when that action ended (None: not yet run); sent_*: when
        # the neighbour (stage+1 for F, stage-1 for B) may use its result.
        self.finish_f: list[list[Optional[float]]] = [[None] * n for _ in range(K)]
        self.finish_b: list[list[Optional[float]]] = [[None] * n for _ in range(K)]
        self.sent_f = [[0.0] * n for _ in range(K)]
        self.sent_b = [[0.0] * n for _ in range(K)]
        self.free_at = [0.0] * K

    def ready_time(self, k: int, action: Action) -> Optional[float]:
        """Earliest start of `action` on stage k, or None while a dependency has not run."""
        i = self.index[action.cell]
        start = self.free_at[k]
        if action.kind == "F":
            if k > 0:
                if self.finish_f[k - 1][i] is None:
                    return None
                start = max(start, self.sent_f[k - 1][i])
        elif action.kind == "W":  # after its own B on this stage, which `validate` orders first
            if self.finish_b[k][i] is None:
                return None
        else:
            own = self.finish_f[k][i]
            if own is None:
                return None
            start = max(start, own)
            if k < self.K - 1:
                if self.finish_b[k + 1][i] is None:
                    return None
                start = max(start, self.sent_b[k + 1][i])
        return start

    def done(self, k: int, action: Action, end: float) -> None:
        i = self.index[action.cell]
        self.free_at[k] = end
        if action.kind == "F":
            self.finish_f[k][i] = end
            if k < self.K - 1:
                self.sent_f[k][i] = end + self.transfer_time(k, action)
        elif action.kind == "B":
            self.finish_b[k][i] = end
            if k > 0:
                self.sent_b[k][i] = end + self.transfer_time(k, action)

    def deadlock(self, pos: list[int]) -> None:
        stages = self.schedule.stages
        stuck = {k: str(stages[k][pos[k]]) for k in range(self.K) if pos[k] < len(stages[k])}
        raise ScheduleError(f"schedule deadlocks: stages wait at {stuck}")


def validate(schedule: Schedule) -> None:
    """Check every stage runs each cell's F (and B) once, in an order the executor can run.

    Raises ScheduleError naming the first broken rule; also detects deadlocks.
    """
    cells = schedule.cells()
    expected_f = {c for c in cells}
    for k, actions in enumerate(schedule.stages):
        seen_f: set[Cell] = set()
        seen_b: set[Cell] = set()
        last_f: dict[tuple[int, int], int] = {}
        last_b: dict[tuple[int, int], int] = {}
        seen_w: set[tuple[int, int]] = set()  # sequences whose last W ran
        early_w: set[Cell] = set()
        for a in actions:
            c = a.cell
            if a.kind == "W":
                if not schedule.defer_wgrad:
                    raise ScheduleError(f"stage {k} runs {a} but the plan computes weight "
                                        "gradients in every backward (defer_wgrad=False)")
                if c not in seen_b:
                    raise ScheduleError(f"stage {k} runs {a} before the backward of its cell")
                if c.sequence_key in seen_w or c in early_w:
                    raise ScheduleError(f"stage {k} runs {a} twice")
                if c.is_first_token_slice:
                    seen_w.add(c.sequence_key)
                else:
                    early_w.add(c)
                continue
            if a.kind == "F":
                if c in seen_f:
                    raise ScheduleError(f"stage {k} runs {a} twice")
                if c.token_slice != last_f.get(c.sequence_key, -1) + 1:
                    raise ScheduleError(f"stage {k} runs {a} before the token slices before it")
                last_f[c.sequence_key] = c.token_slice
                seen_f.add(c)
            else:
                if c in seen_b:
                    raise ScheduleError(f"stage {k} runs {a} twice")
                if c not in seen_f:
                    raise ScheduleError(f"stage {k} runs {a} before its forward")
                prev = last_b.get(c.sequence_key, c.num_token_slices)
                if c.token_slice != prev - 1:
                    raise ScheduleError(
                        f"stage {k} runs {a} out of reverse token order (K/V gradients from later "
                        "slices must be complete first)")
                last_b[c.sequence_key] = c.token_slice
                seen_b.add(c)
        if seen_f != expected_f:
            raise ScheduleError(f"stage {k} runs {len(seen_f)} forwards, expected {len(expected_f)}")
        if not schedule.forward_only and seen_b != expected_f:
            raise ScheduleError(f"stage {k} runs {len(seen_b)} backwards, expected {len(expected_f)}")
        if schedule.forward_only and seen_b:
            raise ScheduleError(f"stage {k} runs backwards in a forward-only schedule")
        if schedule.defer_wgrad and len(seen_w) != len({c.sequence_key for c in expected_f}):
            raise ScheduleError(f"stage {k} runs {len(seen_w)} final weight-gradient (W) actions "
                                "(after a sequence's first token slice), expected one per sequence")
    timeline(schedule, lambda k, a: 1.0)


def format_schedule(schedule: Schedule, stages: Optional[Iterable[int]] = None) -> str:
    """Readable per-stage action lists, for logs and debugging."""
    lines = []
    for k in (stages if stages is not None else range(schedule.num_stages)):
        lines.append(f"stage {k}: " + " ".join(str(a) for a in schedule.stages[k]))
    return "\n".join(lines)


def shared_timeline(schedule: Schedule,
                    compute_time: Callable[[int, Action], float],
                    transfer_time: Callable[[int, Action], float] = lambda stage, action: 0.0,
                    cores: float = 1.0) -> list[TimedAction]:
    """Like `timeline`, for stages that share `cores` processors (processor sharing).

    When n stages compute at once, each runs at min(1, cores / n) of its own speed: e.g. a
    2-stage CPU run on a machine whose processes really share one core. compute_time is the
    action's duration when it runs alone.
    """
    if cores <= 0:
        raise ValueError(f"cores must be positive, got {cores}")
    deps = _Dependencies(schedule, transfer_time)
    K = schedule.num_stages
    pos = [0] * K
    running: dict[int, list] = {}  # stage -> [action, start, remaining seconds of solo work]
    out: list[TimedAction] = []
    now = 0.0
    eps = 1e-12
    while True:
        wake = float("inf")
        for k in range(K):
            if k in running or pos[k] >= len(schedule.stages[k]):
                continue
            action = schedule.stages[k][pos[k]]
            t = deps.ready_time(k, action)
            if t is None:
                continue
            if t <= now + eps:
                running[k] = [action, now, compute_time(k, action)]
            else:
                wake = min(wake, t)
        if not running:
            if wake == float("inf"):
                if any(pos[k] < len(schedule.stages[k]) for k in range(K)):
                    deps.deadlock(pos)
                return out
            now = wake
            continue
        rate = min(1.0, cores / len(running))
        step = min(min(r[2] for r in running.values()) / rate, wake - now)
        now += step
        for k in list(running):
            entry = running[k]
            entry[2] -= step * rate
            if entry[2] <= eps:
                action, start = entry[0], entry[1]
                deps.done(k, action, now)
                out.append(TimedAction(k, action, start, now))
                pos[k] += 1
                del running[k]
