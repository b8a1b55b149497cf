"""Profiles measured on a device, as the planner reads them: time samples and their fits (layers
and edges), the memory fit, and the cost model built on a time fit. The measuring is megatron/measure.

May import: plan, schedule, planner.cost, planner.profile
"""
