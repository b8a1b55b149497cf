"""Megatron-LM's flags: TeraPipe's own, parsed once (settings.py: RunSettings), their checks
before any work, and what they make: the planner's inputs, the plan (searched, measured or fixed), --pipeline-schedule auto, the start-up report.

May import: version, plan, schedule, planner, runtime, megatron.platform, megatron.hooks, megatron.measure, megatron.args
"""
