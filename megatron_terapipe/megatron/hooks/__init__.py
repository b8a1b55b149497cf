"""What runs inside Megatron: the TeraPipe schedule and the getter hook that routes Megatron to
it, config.terapipe (selection.py), the one table of what TeraPipe refuses (rules.py), the
slice-aware layer spec, RoPE offsets, parameter-gradient deferral, P2P, CPU mode, and
the version checks of every private Megatron internal we touch (compat.py).

May import: plan, schedule, runtime, megatron.hooks
"""
