"""Megatron's local linear layers defer their weight gradients inside TeraPipe backward cells.

`ColumnParallelLinear` and `RowParallelLinear` (the output layer included) route their matmul
through `_forward_impl`; inside a cell whose schedule has W actions, the patched one runs
runtime.deferred_linear.DeferredWgradLinear instead, which leaves the weight gradient to the W action.
Everywhere else (no running cell, frozen or non-leaf weights, inputs needing no gradient,
Megatron-FSDP parameters, the output layer's own gradient buffer) Megatron's code runs as is.
"""

from __future__ import annotations

import torch

from ..runtime.context import active_cell
from ..runtime.deferred_linear import DeferredWgradLinear
from . import compat


def _deferring_forward_impl(original):
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    def forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False,
                     allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                     wgrad_deferral_limit=None, tp_group=None, **kwargs):
        active = active_cell()
        if (active is None or active.wgrad is None or not torch.is_grad_enabled()
                or not compat.linear_call_is_deferrable(kwargs)
                or not weight.requires_grad or not input.requires_grad or weight.grad_fn is not None
                or grad_output_buffer is not None or hasattr(weight, "__fsdp_param__")):
            return original(input=input, weight=weight, bias=bias,
                            gradient_accumulation_fusion=gradient_accumulation_fusion,
                            allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                            grad_output_buffer=grad_output_buffer,
                            wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group, **kwargs)
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        return DeferredWgradLinear.apply(input, weight.detach(), bias, gradient_accumulation_fusion,
                                         allreduce_dgrad, sequence_parallel, tp_group, [weight])

    return forward_impl


def install_wgrad_deferral(model: torch.nn.Module) -> int:
    """Let Megatron's local linear layers in `model` defer weight gradients inside TeraPipe
    backward cells. Idempotent; returns how many layers can defer (Transformer Engine layers
    keep computing their weight gradients at once)."""
    linear_classes = compat.parallel_linear_classes()
    count = 0
    for module in model.modules():
        if type(module) not in linear_classes:
            continue
        if not getattr(module, "_terapipe_wgrad_deferral", False):
            module._forward_impl = _deferring_forward_impl(module._forward_impl)
            module._terapipe_wgrad_deferral = True
        count += 1
    return count
