"""What runs inside Megatron: the TeraPipe schedule and the getter hook that routes Megatron to
it, the slice-aware layer spec, RoPE offsets, parameter-gradient deferral, P2P, CPU mode, and
the version checks of every private Megatron internal we touch (compat.py).

May import: plan, schedule, runtime, megatron.hooks
"""
