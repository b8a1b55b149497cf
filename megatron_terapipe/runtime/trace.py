"""Chrome trace of a real run: every rank's per-cell spans, merged into one file on rank 0.

Opens in Perfetto (ui.perfetto.dev) or chrome://tracing, next to the simulator's trace of the
same plan: one process row per pipeline stage, one box per forward/backward cell.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch.distributed as dist

from .executor import RunRecord


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
