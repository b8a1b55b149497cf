"""Every parameter of a stage defers its gradient inside TeraPipe backward cells.

`install_wgrad_deferral(model)` hooks, per module:

- Megatron's local `ColumnParallelLinear` and `RowParallelLinear` (the output layer included):
  their matmul goes through `_forward_impl`; inside a cell whose schedule has W actions the
  patched one runs runtime.wgrad.linear.DeferredWgradLinear instead, which leaves the weight
  gradient (and that of a bias added there: ColumnParallelLinear without skip_bias_add) to the W
  action. A bias the layer adds after its matmul or hands out (skip_bias_add) is replaced, for
  the call, by runtime.wgrad.linear.deferred_bias;
- torch LayerNorm / RMSNorm (what TorchNorm and Megatron's WrappedTorchNorm build):
  runtime.wgrad.norm;
- torch Embedding (learned positions) and Megatron's VocabParallelEmbedding: their F.embedding
  lookups, runtime.wgrad.embedding.

Everywhere else (no running cell, frozen or non-leaf parameters, inputs needing no gradient,
Megatron-FSDP parameters, the output layer's own gradient buffer, Transformer Engine and apex
modules, which compute their gradients their own way) the modules run their own code as is.
"""

from __future__ import annotations

import torch

from ...runtime.wgrad.deferral import deferrable, deferring_store, detached
from ...runtime.wgrad.embedding import defer_embedding
from ...runtime.wgrad.linear import DeferredWgradLinear, deferred_bias
from ...runtime.wgrad.norm import NORM_CLASSES, defer_norm
from ..platform import compat


def _deferring_forward_impl(original, fused_accumulate):
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    def forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False,
                     allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                     wgrad_deferral_limit=None, tp_group=None, **kwargs):
        if (deferring_store(weight) is None or not compat.linear_call_is_deferrable(kwargs)
                or not input.requires_grad or grad_output_buffer is not None):
            return original(input=input, weight=weight, bias=bias,
                            gradient_accumulation_fusion=gradient_accumulation_fusion,
                            allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                            grad_output_buffer=grad_output_buffer,
                            wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group, **kwargs)
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        bias_param = bias if deferrable(bias) else None
        if bias_param is not None:
            bias = detached(bias)
        fused = fused_accumulate if gradient_accumulation_fusion else None
        return DeferredWgradLinear.apply(input, detached(weight), bias,
                                         gradient_accumulation_fusion, allreduce_dgrad,
                                         sequence_parallel, tp_group, [weight, bias_param, fused])

    return forward_impl


def _bias_deferring_forward(module, original, adds_bias_in_matmul: bool):
    """The layer's forward with its bias parameter replaced, for a deferring call, by a
    stand-in whose gradient waits for the W action. Not where `_forward_impl` adds the bias:
    there the weight's piece already carries it."""

    def forward(*args, **kwargs):
        bias = module._parameters.get("bias")
        if (bias is None or (adds_bias_in_matmul and not module.skip_bias_add)
                or deferring_store(bias) is None):
            return original(*args, **kwargs)
        # The forward reads self.bias: for this call it is the stand-in (no copy is made).
        module._parameters["bias"] = deferred_bias(bias)
        try:
            return original(*args, **kwargs)
        finally:
            module._parameters["bias"] = bias

    return forward


def _defer_linear(module: torch.nn.Module, column: type, fused_accumulate) -> None:
    module._forward_impl = _deferring_forward_impl(module._forward_impl, fused_accumulate)
    module.forward = _bias_deferring_forward(module, module.forward, type(module) is column)
    module._terapipe_wgrad_deferral = True


def install_wgrad_deferral(model: torch.nn.Module) -> int:
    """Let the parameters of `model` defer their gradients inside TeraPipe backward cells.
    Idempotent; returns how many parameters can defer (those of the modules above that
    require grad; Transformer Engine layers are not hooked, so they would keep computing their
    gradients at once: not tried, no Transformer Engine on the test machines)."""
    column, row = compat.parallel_linear_classes()
    embeddings = (torch.nn.Embedding, compat.vocab_parallel_embedding_class())
    fused_accumulate = compat.fused_wgrad_accumulate()
    count = 0
    for module in model.modules():
        kind = type(module)
        if kind in (column, row):
            if not getattr(module, "_terapipe_wgrad_deferral", False):
                _defer_linear(module, column, fused_accumulate)
        elif kind in NORM_CLASSES:
            defer_norm(module)
        elif kind in embeddings:
            defer_embedding(module)
        else:
            continue
        count += sum(p.requires_grad for p in module.parameters(recurse=False))
    return count
