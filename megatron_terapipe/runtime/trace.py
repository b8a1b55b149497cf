"""What one schedule call did on a stage (RunRecord), and the Chrome trace of a real run:
every rank's per-cell spans, merged into one file on rank 0.

The trace opens in Perfetto (ui.perfetto.dev) or chrome://tracing, next to the simulator's
trace of the same plan: one process row per pipeline stage, one box per forward/backward cell.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from ..schedule import Action, Cell, Schedule


@dataclass
class CellEvent:
    """Wall-clock span of one compute action on this rank (for traces and simulator fidelity)."""

    stage: int
    kind: str
    cell: Cell
    start: float
    end: float


@dataclass
class RunRecord:
    """One schedule call on one stage. The schedule hands it to `on_run` callbacks (see
    megatron/hooks/forward_backward.py) instead of keeping it anywhere."""

    schedule: Schedule
    stage: int
    actions: tuple[Action, ...]  # the lowered list the stage ran
    events: list[CellEvent] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    deferred_wgrads: int = 0  # parameter gradients the backward cells left to W actions
    receives: int = 0  # activations and gradients this stage received (torch transport)
    receives_posted_early: int = 0  # of which the receive was posted before it was needed
    outputs_deallocated: int = 0  # sent outputs whose data was freed (deallocate_outputs)


CATEGORY = {"F": "forward", "B": "backward", "W": "weight-grad"}


def record_events(record: RunRecord, rank: int, origin: Optional[float] = None) -> list[dict[str, Any]]:
    """Chrome-trace 'X' events (microseconds from `origin`) for one rank's last run."""
    origin = record.start if origin is None else origin
    events = []
    for e in record.events:
        c = e.cell
        events.append({
            "name": f"{e.kind} m{c.microbatch} b{c.batch_slice} t{c.token_slice}",
            "cat": CATEGORY[e.kind],
            "ph": "X", "pid": e.stage, "tid": rank,
            "ts": (e.start - origin) * 1e6, "dur": (e.end - e.start) * 1e6,
            "args": {"microbatch": c.microbatch, "batch_slice": c.batch_slice,
                     "token_slice": c.token_slice, "tokens": c.tokens, "context": c.context,
                     "rows": c.rows},
        })
    return events


def gather_trace(record: RunRecord, path: Optional[str], label: str = "measured") -> Optional[dict]:
    """Collect every rank's spans on rank 0 and write them to `path` (rank 0 returns the trace).

    Clocks differ per process, so each rank's spans are placed relative to its own start of
    the schedule call; all ranks enter the call together (it begins with a receive or a compute
    that the first stage starts at once), so the offsets line up to within a transfer latency.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = record_events(record, rank)
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank != 0:
        return None
    events = [ev for part in gathered for ev in part]
    for stage in sorted({ev["pid"] for ev in events}):
        events.append({"name": "process_name", "ph": "M", "pid": stage,
                       "args": {"name": f"{label} stage {stage}"}})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace
