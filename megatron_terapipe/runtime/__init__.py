"""Running a schedule on one stage, with torch only (Megatron's side is in megatron/).

executor: the loop over a stage's lowered actions; transport: moving activations and gradients
between stages; context: the cell running now; attention and kv_cache: slice attention over
earlier slices' keys and values; wgrad: deferred weight gradients; loss: the last stage's
per-microbatch losses; batching: cutting batches into cells; trace: run records and Chrome
traces; memory: counting saved activations; buffer_pool: buffers at fixed addresses per plan;
cell_graphs: a CUDA graph per compute action; graph_audit: the capture-safety audit.

May import: plan, schedule, runtime
"""
