"""torch LayerNorm / RMSNorm whose weight and bias gradients wait for the schedule's W action.

A norm's backward computes the input gradient, which the previous layer waits for, and the
affine parameters' gradients, sums over every token of products the backward already has. In a
deferring cell LayerNorm runs the aten kernels of torch's own (`native_layer_norm` and its
backward, asked for the input gradient only) and leaves (input, mean, rstd, output gradient) to
the W action, which asks the same backward kernel for the parameters' gradients once over the
sequence's slices put back in token order: in Megatron's [s, b, h] layout that is the unsliced
call's input, so the result is the unsliced one. RMSNorm runs `_fused_rms_norm` forward; its
backward kernel exists on CUDA only, so both gradients are written out here (in float32), the
weight's once per sequence in the W action.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .deferral import deferring_store, detached, hand_over
from .store import DeferredPiece, Gradient

_aten = torch.ops.aten


@dataclass
class NormPiece(DeferredPiece):
    """One slice's norm backward: what the weight and bias gradients need."""

    input: torch.Tensor
    grad_output: torch.Tensor
    mean: Optional[torch.Tensor]  # None for RMSNorm
    rstd: torch.Tensor
    normalized_shape: tuple[int, ...]
    bias: Optional[torch.Tensor]  # the bias parameter (LayerNorm with a bias)
    position: int = 0

    @property
    def param_count(self) -> int:
        return 1 + (self.bias is not None)

    @staticmethod
    def gradients(param: torch.Tensor, pieces: list["NormPiece"]) -> list[Gradient]:
        first = pieces[0]
        shape = list(first.normalized_shape)
        x = _cat([p.input for p in pieces], shape)
        go = _cat([p.grad_output for p in pieces], shape)
        rstd = _cat([p.rstd for p in pieces], [1] * len(shape))
        if first.mean is None:
            rows = tuple(range(x.dim() - len(shape)))
            normed = x.float() * rstd
            return [(param, (go.float() * normed).sum(dim=rows).to(param.dtype))]
        mean = _cat([p.mean for p in pieces], [1] * len(shape))
        bias = first.bias
        _, dw, db = _aten.native_layer_norm_backward(
            go, x, shape, mean, rstd, detached(param), None if bias is None else detached(bias),
            [False, True, bias is not None])
        return [(param, dw)] + ([(bias, db)] if bias is not None else [])


def _cat(parts: list[torch.Tensor], trailing: list[int]) -> torch.Tensor:
    """The parts' rows in one tensor: along dim 0 as they are where only dim 0 differs (the
    token dim of Megatron's [s, b, h]: no reshapes), else as rows of `trailing`."""
    if len(parts) == 1:
        return parts[0]
    if any(p.shape[1:] != parts[0].shape[1:] for p in parts):
        parts = [p.reshape([-1] + trailing) for p in parts]
    return torch.cat(parts)


class DeferredLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, holder):
        out, mean, rstd = _aten.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.normalized_shape, ctx.params = normalized_shape, holder
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, rstd = ctx.saved_tensors
        grad_input = _aten.native_layer_norm_backward(grad_output, x, ctx.normalized_shape, mean,
                                                      rstd, weight, None, [True, False, False])[0]
        weight_param, bias_param = ctx.params
        hand_over(weight_param, NormPiece(x, grad_output, mean, rstd, tuple(ctx.normalized_shape),
                                          bias_param))
        return grad_input, None, None, None, None, None


class DeferredRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps, holder):
        out, rstd = _aten._fused_rms_norm(x, normalized_shape, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.normalized_shape, ctx.parameter = normalized_shape, holder[0]
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, rstd = ctx.saved_tensors
        dims = tuple(range(-len(ctx.normalized_shape), 0))
        normed = x.float() * rstd
        scaled = grad_output.float() * weight.float()
        grad_input = rstd * (scaled - normed * (scaled * normed).mean(dim=dims, keepdim=True))
        grad_input = grad_input.to(x.dtype)
        hand_over(ctx.parameter, NormPiece(x, grad_output, None, rstd,
                                           tuple(ctx.normalized_shape), None))
        return grad_input, None, None, None, None


NORM_CLASSES = (torch.nn.LayerNorm, torch.nn.RMSNorm)


def defer_norm(module: torch.nn.Module) -> None:
    """Let a torch LayerNorm or RMSNorm (exactly those classes: subclasses may compute
    otherwise) defer its affine parameters' gradients inside deferring cells. Idempotent."""
    if type(module) not in NORM_CLASSES or getattr(module, "_terapipe_wgrad_deferral", False):
        return
    original = module.forward
    rms = type(module) is torch.nn.RMSNorm

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, getattr(module, "bias", None)
        # torch's autocast casts layer_norm / rms_norm to float32; the aten calls would not.
        if (weight is None or not x.requires_grad or deferring_store(weight, bias) is None
                or torch.is_autocast_enabled(x.device.type)):
            return original(x)
        shape = list(module.normalized_shape)
        if rms:
            return DeferredRMSNorm.apply(x, detached(weight), shape, module.eps, [weight])
        bias_values = None if bias is None else detached(bias)
        return DeferredLayerNorm.apply(x, detached(weight), bias_values, shape, module.eps,
                                       [weight, bias])

    module.forward = forward
    module._terapipe_wgrad_deferral = True
