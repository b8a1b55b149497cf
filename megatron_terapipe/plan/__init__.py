"""The plan: pure data that says how one microbatch is cut into cells and in which order they
run. Everything else (the schedule, the planner, the runtime, the Megatron glue) reads it; it
imports nothing of theirs.

- terapipe_plan.py: `TeraPipePlan` (token and batch slices, order, W deferral and points,
  virtual stages), a V's chunk layers, and the slice names and grid;
- field_checks.py: the checks its fields get when a plan is made;
- plan_table.py: `PlanTable`, plans by sequence length;
- orders.py: the order names a plan may give.

May import: plan
"""

from .orders import ORDER_NAMES, order_names
from .plan_table import PlanTable
from .terapipe_plan import SliceGrid, SliceNames, TeraPipePlan, TokenSlices, v_chunk_layers

ORDERS = ORDER_NAMES  # the names, as `from megatron_terapipe.plan import ORDERS` reads them

__all__ = ["ORDERS", "ORDER_NAMES", "PlanTable", "SliceGrid", "SliceNames", "TeraPipePlan",
           "TokenSlices", "order_names", "v_chunk_layers"]
