"""The timing and memory replays of a schedule's action lists.

simulator: each stage's timeline and the plan's time; memory_walk: a stage's memory through its
list; list_estimate: a plan's peaks and compute from its lists, as arrays; calibration: what
measured iterations say the simulator missed (a per-cell overhead and a scale), fitted by
re-simulating them, and the cost model corrected by it.

May import: plan, schedule, planner.cost, planner.evaluate
"""
