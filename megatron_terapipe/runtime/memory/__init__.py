"""What a stage's memory holds, counted, and the buffers it reuses.

saved_bytes: the activation bytes autograd keeps alive; buffer_bytes: the buffers the runtime
keeps itself (K/V and their gradients, deferred weight-gradient pieces); buffer_pool: tensors
at fixed addresses for a fixed plan, reused across microbatches and iterations.

May import: runtime.memory, runtime.attention.kv_cache, runtime.wgrad.store
"""
