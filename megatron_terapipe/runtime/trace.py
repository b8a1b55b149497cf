"""What one schedule call did on a stage (RunRecord), and the Chrome trace of a real run:
every rank's per-cell spans, merged into one file on rank 0.

The trace opens in Perfetto (ui.perfetto.dev) or chrome://tracing, next to the simulator's
trace of the same plan: the same writer (schedule/files.py) and the same record of a
timed action (TimedAction), one process row per pipeline stage, one box per compute action.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from ..schedule import Action, Schedule, TimedAction
from ..schedule.files import action_events, chrome_trace_of, write_trace


@dataclass
class RunRecord:
    """One schedule call on one stage. The schedule hands it to `on_run` callbacks (see
    megatron/hooks/forward_backward.py) instead of keeping it anywhere."""

    schedule: Schedule
    stage: int
    actions: tuple[Action, ...]  # the lowered list the stage ran
    # wall-clock span of every compute action (perf_counter seconds), for traces and fidelity
    events: list[TimedAction] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    deferred_wgrads: int = 0  # parameter gradients the backward cells left to W actions
    receives: int = 0  # activations and gradients this stage received (torch transport)
    receives_posted_early: int = 0  # of which the receive was posted before it was needed
    received_elements: int = 0  # elements those receives carried over the pipeline link
    outputs_deallocated: int = 0  # sent outputs whose data was freed (deallocate_outputs)


def record_events(record: RunRecord, rank: int, origin: Optional[float] = None) -> list[dict[str, Any]]:
    """Chrome-trace 'X' events (microseconds from `origin`) for one rank's last run."""
    return action_events(record.events, record.start if origin is None else origin, thread=rank)


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
    trace = chrome_trace_of([ev for part in gathered for ev in part], label,
                            thread_name=lambda tid: f"rank {tid}")
    if path:
        write_trace(trace, path)
    return trace
