"""Cost models: what one pipeline stage costs on one cell, in seconds and in bytes (the
interface, the model shapes and GPU presets, the analytic roofline model, a stage's memory).

May import: plan, schedule, planner.cost
"""
