"""Megatron's versions and platforms: the version checks of every private Megatron internal we
touch (compat.py; compat_moe.py for the MoE router losses, compat_checkpoints.py for Megatron-LM's
checkpoints; compat_check.py runs them all as a report), and CPU mode (cpu.py for Megatron-Core,
cpu_p2p.py for its pipeline sends, lm_cpu.py for Megatron-LM's training script).

Two modules of hooks/ are named below: lm_cpu builds hooks/spec.py's TorchNorm under
--sequence-parallel, and compat_check runs hooks/moe_losses.py's router check with the others.

May import: megatron.platform, megatron.hooks.spec, megatron.hooks.moe_losses
"""
