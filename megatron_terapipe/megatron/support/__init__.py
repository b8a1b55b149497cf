"""What TeraPipe runs and what it refuses, in one room that args/, hooks/ and model/ all read.

refusals.py: the one table of refusals (RULES), each testing a RunView and naming the flag and
the fix; run_views.py: a run as a RunView, from Megatron-LM's flags or a TransformerConfig;
stage_layers.py: how many transformer layers each stage's model chunks hold, as Megatron builds
them (what the rules and the planner both need before the model exists).

May import: plan, runtime.attention.cpu_prefix, megatron.platform, megatron.support
"""
