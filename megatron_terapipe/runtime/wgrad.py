"""Deferred weight gradients: a token slice's backward computes only what the previous stage waits for.

A linear layer's backward is two GEMMs: the input gradient (dgrad), which the previous stage is
waiting for, and the weight gradient (wgrad), which nothing needs before the optimizer step.
With token slices, the per-slice wgrad GEMM is thin (its inner dimension is the slice's tokens),
and it sits on the pipeline's critical path. So, inside a TeraPipe backward cell, Megatron's
local linear layers (`ColumnParallelLinear`, `RowParallelLinear`, the output layer included)
compute dgrad at once and hand (input, output gradient) to a `WeightGradStore`. The schedule's
W action for a sequence then computes every deferred weight gradient of that sequence, one
gradient per weight over all its slices, and delivers it through autograd, so gradient hooks
(Megatron DDP's grad-ready hooks and main_grad accumulation) run exactly as they would have.

Outside a TeraPipe cell, and for frozen weights, weights that are not leaves, inputs that need
no gradient, Megatron-FSDP parameters and the output layer's own
`defer_embedding_wgrad_compute` buffer, the layers run Megatron's original code unchanged
(megatron/linear_deferral.py makes that choice and patches the layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from .context import active_cell

# As Megatron's own linear function: under CUDA autocast, backward runs in the forward's
# autocast state, so its GEMMs see the dtypes the forward saw.
_custom_fwd = partial(torch.amp.custom_fwd, device_type="cuda")
_custom_bwd = partial(torch.amp.custom_bwd, device_type="cuda")


@dataclass
class _Deferred:
    """One backward's share of a weight gradient, waiting for the sequence's W action."""

    input: torch.Tensor  # this rank's input rows (sequence parallel: gathered at flush)
    grad_output: torch.Tensor
    sequence_parallel: bool
    tp_group: Optional[dist.ProcessGroup]
    accumulate_in_main_grad: bool


@dataclass
class WeightGradStore:
    """Deferred weight-gradient pieces per sequence (microbatch, batch slice), per weight."""

    pending: dict[tuple[int, int], dict[int, tuple[torch.Tensor, list[_Deferred]]]] = field(
        default_factory=dict)
    deferred: int = 0  # pieces received so far (each a thin GEMM a backward cell skipped)

    def add(self, sequence_key: tuple[int, int], weight: torch.Tensor, piece: _Deferred) -> None:
        self.deferred += 1
        weights = self.pending.setdefault(sequence_key, {})
        weights.setdefault(id(weight), (weight, []))[1].append(piece)

    def __len__(self) -> int:
        return len(self.pending)

    def flush(self, sequence_key: tuple[int, int]) -> None:
        """Compute and deliver every deferred weight gradient of one sequence."""
        weights = self.pending.pop(sequence_key, None)
        if not weights:
            return
        params, grads = [], []
        for weight, pieces in weights.values():
            with torch.no_grad():  # plain GEMMs (and gathers): no graph to build
                grad = weight_grad(weight, pieces)
            if grad is not None:
                params.append(weight)
                grads.append(grad)
        if params:
            # Backward on the leaves themselves: accumulates into .grad and runs their hooks.
            torch.autograd.backward(params, grads)


def weight_grad(weight: torch.Tensor, pieces: list[_Deferred]) -> Optional[torch.Tensor]:
    """The weight gradient over all pieces. Returns what autograd should accumulate into the
    weight, or None when the gradient already went into main_grad and nothing needs to be told.

    In float32 and float64, each piece's GEMM accumulates into one output (`addmm_`): as fast
    as one GEMM over rows that are already contiguous, without the copies of concatenating them
    (measured on CPU, hidden 512, 8 or 16 slices: 1-4% faster per weight). In 16-bit types the
    pieces are concatenated for one GEMM, which accumulates in float32 and rounds once, as the
    unsliced weight gradient does; adding rounded 16-bit partial sums would lose precision."""
    gos = [p.grad_output.reshape(-1, p.grad_output.size(-1)) for p in pieces]
    inputs = [_gathered(p) for p in pieces]
    if gos[0].dtype not in (torch.float32, torch.float64) and len(pieces) > 1:
        gos, inputs = [torch.cat(gos)], [torch.cat(inputs)]
    wgrad: Optional[torch.Tensor] = None
    for go, inp in zip(gos, inputs):
        if inp.dtype != go.dtype:  # autocast: the forward's GEMM ran in the output's dtype
            inp = inp.to(go.dtype)
        if wgrad is None:
            wgrad = go.t().matmul(inp)
        else:
            wgrad.addmm_(go.t(), inp)
    assert wgrad is not None
    if pieces[0].accumulate_in_main_grad and hasattr(weight, "main_grad"):
        # gradient_accumulation_fusion: the gradient lives in main_grad; autograd only carries
        # a marker so grad-ready hooks fire (as Megatron's own dummy wgrad does).
        weight.main_grad.add_(wgrad)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(weight)
    return wgrad.to(weight.dtype)


def _gathered(piece: _Deferred) -> torch.Tensor:
    x = piece.input
    if piece.sequence_parallel:
        world = piece.tp_group.size()
        total = torch.empty((x.size(0) * world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(total, x.contiguous(), group=piece.tp_group)
        x = total
    return x.reshape(-1, x.size(-1))


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
        piece = _Deferred(input, grad_output, ctx.sequence_parallel, ctx.tp_group, ctx.fusion)
        active = active_cell()
        if active is not None and active.wgrad is not None:
            active.wgrad.add(active.cell.sequence_key, parameter, piece)
        else:  # a backward outside the executor's cells: deliver it now
            grad = weight_grad(parameter, [piece])
            if grad is not None:
                torch.autograd.backward(parameter, grad)
        return grad_input, None, grad_bias, None, None, None, None, None
