"""The one schedule representation: per-stage ordered actions on cells.

A cell is (microbatch, batch slice, token slice). A schedule (build.py) says in which order each
stage runs the forwards (F) and backwards (B) of every cell and, when the plan defers weight
gradients, the W actions that compute them. Lowering (lower.py) adds the communication actions
the stage's transport needs; the executor runs a stage's lowered list, the timing engines
(replay.py) time the same lists, and `validate` (validate.py) checks them. Megatron-Core's
interleaved 1F1B (interleaved.py) is laid out as action lists too, for the timing engines.

May import: plan, schedule
"""

from .actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    Action,
    ActionKind,
    Cell,
    Schedule,
    ScheduleError,
    microbatch_cells,
    microbatch_cells_all,
    opposite,
)
from .build import build_schedule
from .interleaved import ChunkCell, InterleavedSchedule, build_interleaved_schedule
from .lower import Lowering, lower, lower_stage
from .replay import TimedAction, replay_timeline, shared_timeline, timeline
from .validate import validate

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Action",
    "ActionKind",
    "Cell",
    "ChunkCell",
    "InterleavedSchedule",
    "Lowering",
    "Schedule",
    "ScheduleError",
    "TimedAction",
    "build_interleaved_schedule",
    "build_schedule",
    "lower",
    "lower_stage",
    "microbatch_cells",
    "microbatch_cells_all",
    "opposite",
    "replay_timeline",
    "shared_timeline",
    "timeline",
    "validate",
]
