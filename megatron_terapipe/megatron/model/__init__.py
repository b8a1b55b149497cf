"""Into Megatron's model: what TeraPipe changes in the layers a stage builds.

layer_specs.py: Megatron's GPT layer with slice-aware core attention in its slot; rope.py: a
slice's rotary positions start at its first token; param_deferral.py: every parameter defers its
gradient to the schedule's W actions; v_chunks.py: model chunks placed in a V;
moe_router_losses.py: Megatron-Core's MoE router losses, exact under token slices, summed per
microbatch as moe_loss_sums.py says.

May import: plan, schedule, runtime, megatron.platform, megatron.support, megatron.model
"""
