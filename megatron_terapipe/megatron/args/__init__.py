"""Megatron-LM's flags: TeraPipe's own, parsed once (settings.py: RunSettings) from the flags
added by flags.py, and checked before any work (checks.py); what they make: the planner's inputs
(inputs_from_flags.py, with measured profiles cached by profile_cache.py), the plan
(plans_from_flags.py: explicit, uniform or searched; plan_provider.py hands it to every rank),
`--pipeline-schedule auto` (auto_schedule.py: the layout from the prediction; auto_trials.py:
the shortlist timed on real iterations), and the start-up log (startup_log.py).

May import: version, plan, schedule, planner, runtime, megatron.platform, megatron.support, megatron.model, megatron.hooks, megatron.measure, megatron.args
"""
