"""The one schedule representation: per-stage ordered actions on cells.

A cell is (microbatch, batch slice, token slice), on virtual stages also a model chunk
(`VirtualCell`). An action has one spelling (`format_action`, `parse_action`, actions.py).

- build.py: a schedule says in which order each stage runs the forwards (F) and backwards (B)
  of every cell, in one of the registered orders (orders.py; v_order.py for a V), and, when the
  plan defers weight gradients, where the W actions that compute them run;
  `build_lowered_schedule` builds, lowers and validates once per plan and batch shape for the
  executor;
- lower.py: lowering adds the communication actions the stage's transport needs, with the
  message routes between virtual stages (routes.py);
- validate.py: the rules the executor relies on, with the stage x step grid errors show;
- timing.py: the timing engines, which time the same lowered lists with given durations;
- files.py: schedules and Chrome traces (predicted or measured) as files;
- interleaved.py: Megatron-Core's interleaved 1F1B laid out as action lists, for the timing
  engines.

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
from .build import LoweredSchedule, build_lowered_schedule, build_schedule
from .files import dump_schedule, load_schedule
from .interleaved import ChunkCell, InterleavedSchedule, build_interleaved_schedule
from .lower import Lowering, lower, lower_stage
from .orders import ORDERS, order_names
from .timing import replay_timeline, shared_timeline, timeline
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
