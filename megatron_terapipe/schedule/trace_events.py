"""Chrome-trace JSON (Perfetto, chrome://tracing) of timed actions: the one writer for the
simulator's predicted timelines (planner/timeline.py) and the runtime's measured ones
(runtime/trace.py), so a prediction and a run open side by side with the same rows and names.

One process row per pipeline stage, one complete ('X') event per compute action, named as
everywhere else (`format_action`: `F(m0b0t1)`), times in microseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

from .actions import TimedAction, format_action

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
