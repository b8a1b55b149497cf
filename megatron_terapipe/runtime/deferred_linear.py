"""The linear layer whose weight gradient waits for the schedule's W action.

Megatron's tensor-parallel linear, re-done with the same forward and the same input-gradient
communication, whose backward hands (input, output gradient) to the running cell's
WeightGradStore (wgrad.py) instead of computing the weight gradient. megatron/linear_deferral.py
routes Megatron's ColumnParallelLinear and RowParallelLinear through it inside TeraPipe cells.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from .context import active_cell
from .wgrad import WeightGradPiece, weight_grad

# As Megatron's own linear function: under CUDA autocast, backward runs in the forward's
# autocast state, so its GEMMs see the dtypes the forward saw.
_custom_fwd = partial(torch.amp.custom_fwd, device_type="cuda")
_custom_bwd = partial(torch.amp.custom_bwd, device_type="cuda")


class DeferredWgradLinear(torch.autograd.Function):
    """Megatron's tensor-parallel linear (same forward and dgrad communication) whose weight
    gradient goes to the running cell's WeightGradStore instead of being computed at once."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                sequence_parallel, tp_group, holder):
        # `weight` comes in detached: the backward returns no gradient for it, and autograd must
        # not run the parameter's accumulate-grad hooks (DDP's "gradient ready") before the W
        # action delivers the real gradient to `parameter`.
        ctx.save_for_backward(input, weight)
        ctx.parameter = holder[0]  # in a list, so that autograd does not make it an input
        ctx.use_bias = bias is not None
        ctx.fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.tp_group = tp_group
        total = input
        if sequence_parallel:
            world = tp_group.size()
            total = torch.empty((input.size(0) * world,) + tuple(input.shape[1:]),
                                dtype=input.dtype, device=input.device)
            dist.all_gather_into_tensor(total, input.contiguous(), group=tp_group)
        output = torch.matmul(total, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        parameter = ctx.parameter
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=ctx.tp_group)
        elif ctx.sequence_parallel:
            sub = torch.empty(input.shape, dtype=input.dtype, device=input.device)
            dist.reduce_scatter_tensor(sub, grad_input.contiguous(), group=ctx.tp_group)
            grad_input = sub
        grad_bias = None
        if ctx.use_bias:
            grad_bias = grad_output.reshape(-1, grad_output.size(-1)).sum(dim=0)
        piece = WeightGradPiece(input, grad_output, ctx.sequence_parallel, ctx.tp_group, ctx.fusion)
        active = active_cell()
        if active is not None and active.wgrad is not None:
            active.wgrad.add(active.cell.sequence_key, parameter, piece)
        else:  # a backward outside the executor's cells: deliver it now
            grad = weight_grad(parameter, [piece])
            if grad is not None:
                torch.autograd.backward(parameter, grad)
        return grad_input, None, grad_bias, None, None, None, None, None
