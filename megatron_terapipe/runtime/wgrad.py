"""Deferred weight gradients: a token slice's backward computes only what the previous stage waits for.

A linear layer's backward is two GEMMs: the input gradient (dgrad), which the previous stage is
waiting for, and the weight gradient (wgrad), which nothing needs before the optimizer step.
With token slices, the per-slice wgrad GEMM is thin (its inner dimension is the slice's tokens),
and it sits on the pipeline's critical path. So, inside a TeraPipe backward cell, Megatron's
local linear layers (`ColumnParallelLinear`, `RowParallelLinear`, the output layer included)
compute dgrad at once and hand (input, output gradient) to a `WeightGradStore`
(deferred_linear.py). The schedule's
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
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class WeightGradPiece:
    """One backward's share of a weight gradient, waiting for the sequence's W action."""

    input: torch.Tensor  # this rank's input rows (sequence parallel: gathered at flush)
    grad_output: torch.Tensor
    sequence_parallel: bool
    tp_group: Optional[dist.ProcessGroup]
    accumulate_in_main_grad: bool


@dataclass
class WeightGradStore:
    """Deferred weight-gradient pieces per sequence (microbatch, batch slice), per weight."""

    pending: dict[tuple[int, int], dict[int, tuple[torch.Tensor, list[WeightGradPiece]]]] = field(
        default_factory=dict)
    deferred: int = 0  # pieces received so far (each a thin GEMM a backward cell skipped)

    def add(self, sequence_key: tuple[int, int], weight: torch.Tensor, piece: WeightGradPiece) -> None:
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


def weight_grad(weight: torch.Tensor, pieces: list[WeightGradPiece]) -> Optional[torch.Tensor]:
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


def _gathered(piece: WeightGradPiece) -> torch.Tensor:
    x = piece.input
    if piece.sequence_parallel:
        world = piece.tp_group.size()
        total = torch.empty((x.size(0) * world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(total, x.contiguous(), group=piece.tp_group)
        x = total
    return x.reshape(-1, x.size(-1))
