"""Messages between stages and between data-parallel replicas.

transport: point-to-point sends and receives of activations and gradients between neighbouring
pipeline stages; scatter_gather: each TP rank sends 1/TP of a message and the receivers
all-gather it; grad_sync: Megatron's gradient-sync protocol (no_sync, grad_sync_func) placed on
a stage's lowered list.

May import: plan, schedule, runtime.comm, runtime.memory
"""
