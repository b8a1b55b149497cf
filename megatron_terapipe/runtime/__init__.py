"""Running a schedule on one stage, with torch only (Megatron's side is in megatron/).

executor: the loop over a stage's lowered actions; transport: moving activations and gradients
between stages; context: the cell running now; batching: cutting batches into cells; attention
and kv_cache: slice attention over earlier slices' keys and values (prefix_attention: on CPU,
long slices without the masked scores); loss: the last stage's per-microbatch losses; grad_sync:
Megatron's gradient-sync protocol on a stage's list; trace: run records and Chrome traces;
memory: counting saved activations; buffer_meter: counting the buffers the runtime keeps itself;
buffer_pool: buffers at fixed addresses per plan. Folders:
wgrad/ (deferred weight gradients: the store and the deferring layers), graphs/ (a CUDA graph
per compute action, the capture-safety audit, a CPU stand-in that replays like a CUDA graph).

May import: plan, schedule, runtime
"""
