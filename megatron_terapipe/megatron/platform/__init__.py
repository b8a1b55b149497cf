"""Megatron's versions and platforms, the lowest floor of the glue: the version checks of every
private Megatron internal we touch (compat.py; router_versions.py for the MoE router and its
losses, checkpoint_versions.py for Megatron-LM's checkpoints; version_report.py runs them all
as a report: python -m megatron_terapipe.megatron.platform.version_report), and CPU mode
(cpu_mode.py for Megatron-Core, cpu_sends.py for its pipeline sends, lm_cpu.py for Megatron-LM's
training script, torch_norm.py for the norm that runs sequence-parallel on gloo).

May import: megatron.platform
"""
