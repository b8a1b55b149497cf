"""Embedding tables whose gradient waits for the schedule's W action.

An embedding's weight gradient is dense: every backward fills a [vocabulary, hidden] tensor and
adds it to the parameter's, once per token slice. In a deferring cell the module's
`F.embedding` lookups of its own table (found with a TorchFunctionMode, so that the module's
other work, e.g. Megatron's vocabulary-parallel masking and all-reduce, runs as written) go
through `DeferredEmbedding`, whose backward keeps (ids, output gradient); the W action computes
one dense gradient per sequence from all slices, put back in token order (the ids' last
dimension: Megatron's [b, s] layout), which is the unsliced backward's input.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .deferral import anchor, deferring_store, detached, hand_over
from .store import DeferredPiece, Gradient

_EMBEDDING_SIGNATURE = inspect.signature(F.embedding)


@dataclass
class EmbeddingPiece(DeferredPiece):
    input: torch.Tensor  # the looked-up ids
    grad_output: torch.Tensor  # ids.shape + (hidden,)
    num_weights: int
    padding_idx: int
    position: int = 0

    @staticmethod
    def gradients(param: torch.Tensor, pieces: list["EmbeddingPiece"]) -> list[Gradient]:
        token_dim = pieces[0].input.dim() - 1
        ids = torch.cat([p.input for p in pieces], dim=token_dim)
        grad = torch.cat([p.grad_output for p in pieces], dim=token_dim)
        first = pieces[0]
        dense = torch.ops.aten.embedding_dense_backward(grad, ids, first.num_weights,
                                                        first.padding_idx, False)
        return [(param, dense.to(param.dtype))]


class DeferredEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor_tensor, ids, weight, padding_idx, holder):
        ctx.save_for_backward(ids)
        ctx.num_weights, ctx.padding_idx, ctx.parameter = weight.size(0), padding_idx, holder[0]
        return F.embedding(ids, weight, padding_idx if padding_idx >= 0 else None)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        hand_over(ctx.parameter, EmbeddingPiece(ids, grad_output, ctx.num_weights, ctx.padding_idx))
        return None, None, None, None, None


class _DeferredLookups(TorchFunctionMode):
    """Inside one module's forward: `F.embedding(ids, weight)` of that module's table, as a
    plain lookup (no max_norm, no frequency scaling, not sparse), becomes DeferredEmbedding."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            padding_idx = _plain_lookup_padding(self.weight, args, kwargs)
            if padding_idx is not None:
                weight = self.weight
                return DeferredEmbedding.apply(anchor(weight.device), args[0], detached(weight),
                                               padding_idx, [weight])
        return func(*args, **kwargs)


def _plain_lookup_padding(weight: torch.Tensor, args, kwargs) -> Optional[int]:
    """The padding index (-1: none) of an F.embedding call that looks up `weight` plainly."""
    call = _EMBEDDING_SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    if (a["weight"] is not weight or a["max_norm"] is not None or a["scale_grad_by_freq"]
            or a["sparse"] or a["input"].is_floating_point()):
        return None
    padding = a["padding_idx"]
    if padding is None:
        return -1
    return padding if padding >= 0 else padding + weight.size(0)


def defer_embedding(module: torch.nn.Module) -> None:
    """Let a module that looks its `weight` table up with F.embedding (torch's Embedding,
    Megatron's VocabParallelEmbedding) defer that table's gradient in deferring cells."""
    if getattr(module, "_terapipe_wgrad_deferral", False):
        return
    original = module.forward

    def forward(*args, **kwargs):
        if deferring_store(module.weight) is None:
            return original(*args, **kwargs)
        with _DeferredLookups(module.weight):
            return original(*args, **kwargs)

    module.forward = forward
    module._terapipe_wgrad_deferral = True
