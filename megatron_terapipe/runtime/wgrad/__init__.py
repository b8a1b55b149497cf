"""Deferred weight gradients: inside a TeraPipe backward cell, each parameter leaves what its
gradient needs to the schedule's W action.

store: the WeightGradStore and the pieces it keeps (the module docstring says why); deferral:
what the deferring layers share; linear, norm, embedding: the deferring tensor-parallel linear
(and deferred biases), torch LayerNorm / RMSNorm, and embedding lookups.

May import: runtime.context, runtime.wgrad
"""
