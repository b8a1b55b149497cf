"""Schedules in files: per-stage compute lists written out and read back, as
torch.distributed.pipelining's `_dump_csv` / `_load_csv`, so that a schedule can be read,
diffed, edited by hand, or handed in.

The file is JSON: the plan (`TeraPipePlan.to_dict`), the batch shape, and per stage its
compute actions in the one action spelling (actions.py):

    {"format": "megatron-terapipe schedule", "version": 1,
     "plan": {"seq_slices": [4, 4], "order": "1f1b", ...},
     "num_microbatches": 2, "micro_batch_size": 1, "forward_only": false,
     "stages": [["F(m0b0t0)", "F(m0b0t1)", "F(m1b0t0)", "B(m0b0t1)", ...], ...]}

Loading validates the schedule (`validate`: ScheduleError with the stage x step grid), so a
file that would deadlock or break a dependency fails there, not in a run. Communication
actions are not written: lowering adds them for the transport that runs the schedule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

from ..plan import TeraPipePlan
from .actions import Schedule, TimedAction, cells_by_name, format_action, parse_action
from .lower import Lowering
from .validate import validate

FORMAT = "megatron-terapipe schedule"
VERSION = 1
PathLike = Union[str, Path]


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    """The file's content for `schedule` (a TeraPipe schedule, built or loaded)."""
    if type(schedule) is not Schedule:
        raise TypeError(
            f"dump_schedule writes TeraPipe schedules, not a {type(schedule).__name__}: "
            "Megatron's interleaved schedule is rebuilt by build_interleaved_schedule")
    return {"format": FORMAT, "version": VERSION, "plan": schedule.plan.to_dict(),
            "num_microbatches": schedule.num_microbatches,
            "micro_batch_size": schedule.micro_batch_size,
            "forward_only": schedule.forward_only,
            "stages": [[format_action(a) for a in actions] for actions in schedule.stages]}


def schedule_from_dict(data: dict[str, Any], lowering: Lowering = Lowering()) -> Schedule:
    """The schedule `schedule_to_dict` wrote, validated for `lowering` (ValueError naming
    what the content lacks; ScheduleError with the grid for a schedule that cannot run)."""
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ValueError(f"not a schedule file: expected format {FORMAT!r} version {VERSION}, "
                         f"got {data.get('format')!r} version {data.get('version')!r}")
    missing = [key for key in ("plan", "num_microbatches", "micro_batch_size", "stages")
               if key not in data]
    if missing:
        raise ValueError(f"the schedule file lacks {', '.join(missing)}")
    plan = TeraPipePlan.from_dict(data["plan"])
    num_microbatches, micro_batch_size = int(data["num_microbatches"]), int(data["micro_batch_size"])
    shape = Schedule(plan, num_microbatches, micro_batch_size, bool(data.get("forward_only")), ())
    cells = cells_by_name(shape.cells())
    stages = []
    for k, texts in enumerate(data["stages"]):
        actions = tuple(parse_action(text, cells) for text in texts)
        talking = [format_action(a) for a in actions if not a.is_compute]
        if talking:
            raise ValueError(
                f"stage {k} of the schedule file lists communication actions ({talking[0]}, "
                "...): list compute actions (F, B, W) only; lowering adds the messages")
        stages.append(actions)
    if not stages:
        raise ValueError("the schedule file lists no stages")
    schedule = Schedule(plan, num_microbatches, micro_batch_size, shape.forward_only, tuple(stages))
    validate(schedule, lowering)
    return schedule


def dump_schedule(schedule: Schedule, path: PathLike) -> Path:
    """Write `schedule`'s per-stage compute lists (and its plan and shape) to `path`."""
    path = Path(path)
    data = schedule_to_dict(schedule)
    # one line per entry and per stage: readable, and a hand edit shows as a one-line diff
    stages = ",\n  ".join(json.dumps(actions) for actions in data.pop("stages"))
    lines = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items()]
    path.write_text("{\n" + ",\n".join(lines + [f' "stages": [\n  {stages}\n ]']) + "\n}\n")
    return path


def load_schedule(path: PathLike, lowering: Lowering = Lowering()) -> Schedule:
    """The schedule in `path` (written by `dump_schedule`, or by hand), validated."""
    with open(path) as f:
        data = json.load(f)
    return schedule_from_dict(data, lowering)


# Chrome-trace JSON (Perfetto, chrome://tracing) of timed actions: the one writer for the
# simulator's predicted timelines (planner/cli/timeline.py) and the runtime's measured ones
# (runtime/trace.py), so a prediction and a run open side by side with the same rows and names.
#
# One process row per pipeline stage, one complete ('X') event per compute action, named as
# everywhere else (`format_action`: `F(m0b0t1)`), times in microseconds.

CATEGORY = {"F": "forward", "B": "backward", "W": "weight-grad"}
PathLike = Union[str, Path]


def action_events(timed: Iterable[TimedAction], origin: float = 0.0,
                  thread: int = 0) -> list[dict[str, Any]]:
    """One 'X' event per timed action, its times in microseconds from `origin` (seconds)."""
    events = []
    for ta in timed:
        c = ta.action.cell
        events.append({
            "name": format_action(ta.action), "cat": CATEGORY[ta.action.kind],
            "ph": "X", "pid": ta.stage, "tid": thread,
            "ts": (ta.start - origin) * 1e6, "dur": (ta.end - ta.start) * 1e6,
            "args": {"microbatch": c.microbatch, "batch_slice": c.batch_slice,
                     "token_slice": c.token_slice, "rows": c.rows, "tokens": c.tokens,
                     "context": c.context},
        })
    return events


def chrome_trace_of(events: list[dict[str, Any]], label: str = "",
                    thread_name: Callable[[int], str] = lambda tid: "compute",
                    other_data: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The trace document: `events`, then a name per stage row (`"{label} stage k"`, or
    `"stage k"` without a label) and per thread, and `other_data` when given."""
    named: list[dict[str, Any]] = []
    for stage in sorted({ev["pid"] for ev in events}):
        named.append({"ph": "M", "name": "process_name", "pid": stage, "tid": 0,
                      "args": {"name": f"{label} stage {stage}" if label else f"stage {stage}"}})
        named.append({"ph": "M", "name": "process_sort_index", "pid": stage, "tid": 0,
                      "args": {"sort_index": stage}})
    for stage, tid in sorted({(ev["pid"], ev["tid"]) for ev in events if ev["ph"] == "X"}):
        named.append({"ph": "M", "name": "thread_name", "pid": stage, "tid": tid,
                      "args": {"name": thread_name(tid)}})
    trace: dict[str, Any] = {"traceEvents": named + events, "displayTimeUnit": "ms"}
    if other_data is not None:
        trace["otherData"] = other_data
    return trace


def write_trace(trace: dict[str, Any], path: PathLike) -> Path:
    path = Path(path)
    path.write_text(json.dumps(trace))
    return path
