"""Runs that measure what the planner predicts: each stage's memory (memory_runs, sp_memory),
what an iteration costs the host (host_cost) and the timed iterations of each schedule
(schedule_runs)."""
