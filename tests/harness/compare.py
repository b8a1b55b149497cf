"""Weights and gradients between a full model and its pipeline/tensor shards, and the checks
that a TeraPipe run's gradients and reported losses equal Megatron's.

Workers return, per parameter, the pair (TeraPipe's gradient, the reference gradient cut to the
same shard), both float32, and the reported loss values; the test process checks them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

Pairs = dict[str, tuple[Optional[torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class Tolerance:
    """How close a TeraPipe run must be to Megatron's on the same model, weights and batches.

    max_normalised: bound on max|g - g_ref| / max|g_ref| for every parameter (the worst
        element, in units of that parameter's largest reference gradient).
    grad_rtol, grad_atol: every gradient element, |g - g_ref| <= grad_atol + grad_rtol * |g_ref|
        (torch.testing.assert_close). Gradients are of the loss Megatron backpropagates: the
        masked token sum divided by the token count and by the microbatch count, so atol is
        in those units (with calculate_per_token_loss the gradients are of the plain sum:
        check_case divides both sides by the loss tokens first, into the same units).
    loss_rtol, loss_atol: the same element-wise test on every value the last stage reports.
    zero_below: a parameter whose reference gradient is nowhere larger is zero up to rounding
        (a key norm's bias without RoPE: the softmax ignores a shift all keys share), where
        max_normalised would divide rounding by rounding; only the element-wise test holds it.
    """

    max_normalised: float
    grad_rtol: float
    grad_atol: float
    loss_rtol: float
    loss_atol: float
    zero_below: float = 0.0


# float32: only the summation order differs (slices split the attention and matmul sums).
# Measured on the equivalence cases: max-normalised <= 8.7e-7; with rtol 1e-4 every element
# within 3.4e-8, and the per-token-loss cases within about 7e-8 once divided by their loss
# tokens (3 microbatches of 2 x 16 positions, about a third masked; one linear_proj.bias
# element, a sum that cancels, differs by 3.9e-6 before the division); losses
# within 1.3e-7 relative (one float32 ulp of the summed loss).
# A gradient that is zero in exact arithmetic came out below 2e-10 on both sides.
FP32 = Tolerance(max_normalised=1e-5, grad_rtol=1e-4, grad_atol=1e-6, loss_rtol=1e-6,
                 loss_atol=1e-6, zero_below=1e-8)
# bfloat16 (8 mantissa bits): each side rounds its own partial sums. Measured: max-normalised
# 1.6e-2; with rtol 1e-2 every element within 1.5e-3; losses within 3.9e-5 relative.
BF16 = Tolerance(max_normalised=5e-2, grad_rtol=1e-2, grad_atol=5e-3, loss_rtol=5e-4,
                 loss_atol=1e-3)


def unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def global_name(model, name: str) -> str:
    """decoder.layers.<local>.x -> decoder.layers.<global>.x using each layer's layer_number."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        local = int(parts[2])
        parts[2] = str(model.decoder.layers[local].layer_number - 1)
    return ".".join(parts)


def _shard(full: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    from megatron.core import parallel_state

    if getattr(param, "tensor_model_parallel", False):
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        return full.chunk(tp, dim=param.partition_dim)[rank]
    return full


def _full_name(inner, name: str, full: dict) -> str:
    gname = global_name(inner, name)
    if gname not in full and gname == "output_layer.weight":
        return "embedding.word_embeddings.weight"  # tied output layer on the last stage
    return gname


def load_full_state(model, full_state: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) model's weights into this rank's pipeline/tensor shard."""
    inner = unwrap(model)
    with torch.no_grad():
        for name, param in inner.named_parameters():
            full = full_state[_full_name(inner, name, full_state)]
            param.copy_(_shard(full, param).to(param.dtype))


def grad_pairs(model, full_grads: dict[str, torch.Tensor]) -> Pairs:
    """Per parameter of this shard, by global name: (its gradient, main_grad under Megatron
    DDP, or None; the full model's gradient cut to the same shard), as float32 copies."""
    inner = unwrap(model)
    out: Pairs = {}
    for name, param in inner.named_parameters():
        g = getattr(param, "main_grad", None)
        if g is None:
            g = param.grad
        ref = _shard(full_grads[_full_name(inner, name, full_grads)], param)
        out[global_name(inner, name)] = (None if g is None else g.detach().float().clone(),
                                         ref.detach().float().clone())
    return out


def chunk_grads(chunks, zeros_if_absent: bool = False) -> dict[str, Optional[torch.Tensor]]:
    """Every chunk's gradients by global name (main_grad under Megatron DDP, else .grad), as
    float32 copies; a parameter with neither: None, or zeros of its shape (`zeros_if_absent`)."""
    out = {}
    for inner in map(unwrap, chunks):
        for name, param in inner.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is None and zeros_if_absent:
                grad = torch.zeros_like(param)
            out[global_name(inner, name)] = None if grad is None else grad.detach().float().clone()
    return out


def max_relative_error(pairs: Pairs) -> tuple[float, str]:
    """Worst over parameters of max|g - g_ref| / max|g_ref|, and that parameter's name."""
    worst, worst_name = 0.0, ""
    for name, (g, ref) in pairs.items():
        if g is None:
            err = float("inf") if ref.abs().max() > 0 else 0.0
        else:
            err = float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name


def check_gradients(pairs: Pairs, tol: Tolerance, where: str) -> None:
    """Every parameter's gradient against the reference: the max-normalised bound (for those
    above `zero_below`), then every element with assert_close. A missing gradient counts as
    zeros."""
    assert pairs, f"{where}: no parameters"
    err, name = max_relative_error({n: (g, ref) for n, (g, ref) in pairs.items()
                                    if ref.abs().max() > tol.zero_below})
    assert err <= tol.max_normalised, f"{where}: gradient of {name} off by {err:.2e} (max-normalised)"
    for name, (g, ref) in pairs.items():
        torch.testing.assert_close(
            torch.zeros_like(ref) if g is None else g, ref, rtol=tol.grad_rtol,
            atol=tol.grad_atol, msg=lambda m, name=name: f"{where}: gradient of {name}: {m}")


def report_values(losses: list[Any]) -> list[list[float]]:
    """The 'lm loss' report of every microbatch as a list of floats ([sum, count] or [mean])."""
    return [[float(x) for x in torch.as_tensor(rep["lm loss"]).float().view(-1)] for rep in losses]


def check_losses(got: list[list[float]], ref: list[list[float]], tol: Tolerance, where: str) -> None:
    """Every reported value of every microbatch, element-wise (the lists must match in shape)."""
    assert len(got) == len(ref) > 0, f"{where}: {len(got)} loss reports, expected {len(ref)}"
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=tol.loss_rtol,
                               atol=tol.loss_atol, msg=lambda m: f"{where}: reported losses: {m}")
