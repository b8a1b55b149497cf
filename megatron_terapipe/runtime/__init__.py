"""Running a schedule on one stage, with torch only (Megatron's side is in megatron/).

executor: the loop over a stage's lowered actions; stage_setup: what a stage checks before it
runs; context: the cell running now (the one implicit channel, see its docstring); batching:
cutting batches into cells; loss: the last stage's per-microbatch losses; trace: run records
and Chrome traces. Folders:
comm/ (moving activations and gradients between stages; Megatron's gradient sync),
attention/ (slice attention over earlier slices' keys and values, the K/V cache),
memory/ (counting saved activations and runtime buffers; buffers at fixed addresses),
wgrad/ (deferred weight gradients: the store and the deferring layers),
graphs/ (a CUDA graph per compute action, the capture-safety audit, a CPU stand-in that
replays like a CUDA graph).

May import: plan, schedule, runtime
"""
