"""What runs inside Megatron: the TeraPipe schedule (forward_backward.py) and the getter hook
that routes Megatron to it (install.py), config.terapipe (selection.py), the one table of what
TeraPipe refuses (rules.py) and the layers each stage holds (stage_layers.py), P2P (p2p.py),
Megatron-LM's forward step per cell (lm_cells.py); and into Megatron's model: the slice-aware
layer spec (spec.py), RoPE offsets (rope.py), parameter-gradient deferral (param_deferral.py),
exact MoE router losses (moe_losses.py, moe_loss_terms.py). The version checks and CPU mode
are platform/.

May import: plan, schedule, runtime, megatron.platform, megatron.hooks
"""
