"""The linear layer whose weight gradient waits for the schedule's W action, and deferred biases.

Megatron's tensor-parallel linear, re-done with the same forward and the same input-gradient
communication, whose backward hands (input, output gradient) to the running cell's
WeightGradStore (store.py) instead of computing the weight gradient; a bias added inside the
layer takes its gradient from the same output gradients in the W action. A bias the layer hands
out to be added elsewhere (Megatron's skip_bias_add, or RowParallelLinear's add after its
all-reduce) goes through `DeferredBias`, whose backward keeps the per-slice gradient for the W
action. megatron/model/param_deferral.py routes Megatron's ColumnParallelLinear and
RowParallelLinear through them inside TeraPipe cells.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from .deferral import anchor, detached, hand_over
from .store import DeferredPiece, Gradient, WeightGradPiece, accumulation_dtype, all_gathered

# As Megatron's own linear function: under CUDA autocast, backward runs in the forward's
# autocast state, so its GEMMs see the dtypes the forward saw.
_custom_fwd = partial(torch.amp.custom_fwd, device_type="cuda")
_custom_bwd = partial(torch.amp.custom_bwd, device_type="cuda")


class DeferredWgradLinear(torch.autograd.Function):
    """Megatron's tensor-parallel linear (same forward and dgrad communication) whose weight
    gradient (and its bias's, when holder names the bias parameter) goes to the running cell's
    WeightGradStore instead of being computed at once."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                sequence_parallel, tp_group, holder):
        # `weight` (and a deferred bias) come in detached: the backward returns no gradient for
        # them, and autograd must not run the parameters' accumulate-grad hooks (DDP's
        # "gradient ready") before the W action delivers the real gradients to the parameters.
        ctx.save_for_backward(input, weight)
        ctx.parameter, ctx.bias_parameter, ctx.fused = holder  # a list: not autograd inputs
        ctx.use_bias = bias is not None
        ctx.fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.tp_group = tp_group
        total = all_gathered(input, tp_group) if sequence_parallel else input
        output = torch.matmul(total, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=ctx.tp_group)
        elif ctx.sequence_parallel:
            sub = torch.empty(input.shape, dtype=input.dtype, device=input.device)
            dist.reduce_scatter_tensor(sub, grad_input.contiguous(), group=ctx.tp_group)
            grad_input = sub
        grad_bias = None
        if ctx.use_bias and ctx.bias_parameter is None:  # a bias that is not deferred
            grad_bias = grad_output.reshape(-1, grad_output.size(-1)).sum(dim=0)
        hand_over(ctx.parameter, WeightGradPiece(input, grad_output, ctx.sequence_parallel,
                                                 ctx.tp_group, ctx.fusion, ctx.bias_parameter,
                                                 ctx.fused))
        return grad_input, None, grad_bias, None, None, None, None, None


@dataclass
class BiasGradPiece(DeferredPiece):
    """A bias's gradient from one slice, already summed over its tokens by the add's backward."""

    grad_output: torch.Tensor
    position: int = 0

    @property
    def input(self) -> torch.Tensor:
        return self.grad_output

    @staticmethod
    def gradients(param: torch.Tensor, pieces: list["BiasGradPiece"]) -> list[Gradient]:
        if len(pieces) == 1:
            return [(param, pieces[0].grad_output)]
        stacked = torch.stack([p.grad_output for p in pieces])
        total = stacked.sum(dim=0, dtype=accumulation_dtype(stacked.dtype))
        return [(param, total.to(param.dtype))]


class DeferredBias(torch.autograd.Function):
    """The bias's values for the layer to add wherever it adds them; its gradient (autograd sums
    it over the tokens) goes to the running cell's store, one piece per slice."""

    @staticmethod
    def forward(ctx, anchor_tensor, bias, holder):
        ctx.parameter = holder[0]
        return bias.view_as(bias)

    @staticmethod
    def backward(ctx, grad):
        hand_over(ctx.parameter, BiasGradPiece(grad))
        return None, None, None


def deferred_bias(bias: torch.Tensor) -> torch.Tensor:
    """A stand-in for the bias parameter inside a deferring cell (see DeferredBias)."""
    return DeferredBias.apply(anchor(bias.device), detached(bias), [bias])
