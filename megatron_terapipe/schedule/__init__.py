"""The one schedule representation: per-stage ordered actions on cells.

A cell is (microbatch, batch slice, token slice), on virtual stages also a model chunk
(`VirtualCell`). A schedule (build.py) says in which order each
stage runs the forwards (F) and backwards (B) of every cell, in one of the registered orders
(orders.py), and, when the plan defers weight gradients, the W actions that compute them.
Lowering (lower.py) adds the communication actions the stage's transport needs; `validate`
(validate.py) checks a schedule and its lowered lists; `build_lowered_schedule` (lowered.py)
does all three once per plan and batch shape for the executor, and the timing engines
(replay.py) time the same lists. An action has one spelling (`format_action`, `parse_action`,
actions.py); schedule_file.py writes and reads schedules as files; trace_events.py writes the
Chrome trace of timed actions, predicted or measured. Megatron-Core's interleaved 1F1B
(interleaved.py) is laid out as action lists too, for the timing engines.

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
    TimedAction,
    VirtualCell,
    cells_by_name,
    format_action,
    microbatch_cells,
    microbatch_cells_all,
    opposite,
    parse_action,
)
from .build import build_schedule
from .interleaved import ChunkCell, InterleavedSchedule, build_interleaved_schedule
from .lower import Lowering, lower, lower_stage
from .lowered import LoweredSchedule, build_lowered_schedule
from .orders import ORDERS, order_names
from .replay import replay_timeline, shared_timeline, timeline
from .schedule_file import dump_schedule, load_schedule
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
    "LoweredSchedule",
    "ORDERS",
    "Schedule",
    "ScheduleError",
    "TimedAction",
    "VirtualCell",
    "build_interleaved_schedule",
    "build_lowered_schedule",
    "build_schedule",
    "cells_by_name",
    "dump_schedule",
    "format_action",
    "load_schedule",
    "lower",
    "lower_stage",
    "microbatch_cells",
    "microbatch_cells_all",
    "opposite",
    "order_names",
    "parse_action",
    "replay_timeline",
    "shared_timeline",
    "timeline",
    "validate",
]
