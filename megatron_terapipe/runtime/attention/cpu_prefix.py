"""A token slice's causal attention over its cached prefix on CPU, without the masked triangle.

On a GPU, SDPA takes a bottom-right causal bias and its flash kernels skip what the mask hides.
CPU SDPA has no such flag: with the explicit mask, each later slice's call also computes the
scores it then masks away, a triangle of (slice tokens)^2 / 2 per head, 25% more query-key
pairs than the whole sequence's causal call at 2 slices (benchmarks/bench_cpu_slice_costs.py).

Here the call is split in two blocks, each of which CPU's flash kernel runs without waste: the
earlier tokens' keys (every query sees all of them: no mask) and the slice's own keys (a square
causal block: `is_causal`). The blocks' outputs are merged by their log-sum-exps, as flash
attention merges its key blocks. Backward gives each block the merged output and log-sum-exp,
from which the kernel's backward recomputes that block's share of the whole softmax exactly;
the query gradient is the sum of the two. The kernel is torch's private
`_scaled_dot_product_flash_attention_for_cpu` (the op CPU SDPA runs for these calls); where a
torch lacks it, `prefix_attention_available()` is False and the caller keeps the masked call.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten

#: Slices of at most this many tokens keep the masked call. CPU's flash kernel works in blocks
#: of 512 keys and skips, under `is_causal`, only whole blocks above the diagonal: a slice's own
#: block of 512 tokens or fewer is one key block, which it computes whole either way, and the
#: split's second call and merge cost more than they save. Measured on this project's CPU
#: (torch 2.13, one thread, 8 heads of 64, one slice over 2 or 3 times its length, forward +
#: backward: benchmarks/results/cpu/slice_costs.json), the split took
#: 0.84-0.85x the masked call's time at 1024 tokens, 0.86-0.92x at 640-768, 0.97-1.07x at
#: 384-512 and 1.05-1.25x at 128-256.
SPLIT_ABOVE_TOKENS = 512


def prefix_attention_available() -> bool:
    """Whether this torch has the CPU flash kernel and its backward (torch 2.13 has both: the
    suite runs on it)."""
    return (hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu")
            and hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))


class _PrefixCausalAttention(torch.autograd.Function):
    """q [b, h, sq, d] over k, v [b, h, sk, d] (sk > sq): query i sees keys up to sk - sq + i."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        prefix = k.size(2) - q.size(2)
        flash = _aten._scaled_dot_product_flash_attention_for_cpu
        out_prefix, lse_prefix = flash(q, k[:, :, :prefix], v[:, :, :prefix], scale=scale)
        out_own, lse_own = flash(q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True,
                                 scale=scale)
        lse = torch.logaddexp(lse_prefix, lse_own)  # float32 (float64 for float64 inputs)
        out = (out_prefix * (lse_prefix - lse).exp_().unsqueeze(-1)
               + out_own * (lse_own - lse).exp_().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        prefix = k.size(2) - q.size(2)
        backward = _aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq_prefix, dk_prefix, dv_prefix = backward(
            grad, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, 0.0, False, scale=ctx.scale)
        dq_own, dk_own, dv_own = backward(
            grad, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, 0.0, True, scale=ctx.scale)
        return (dq_prefix.add_(dq_own), torch.cat((dk_prefix, dk_own), 2),
                torch.cat((dv_prefix, dv_own), 2), None)


def prefix_split_pays(queries: int) -> bool:
    """Whether a slice of `queries` tokens is faster split than masked (SPLIT_ABOVE_TOKENS)."""
    return queries > SPLIT_ABOVE_TOKENS


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Bottom-right causal attention of q [b, h, sq, d] over k, v [b, h, sk, d], sk > sq, on
    CPU, no dropout: what SDPA with `attention._lower_right_mask(sq, sk)` computes."""
    if k.size(2) <= q.size(2):
        raise ValueError(f"prefix attention needs more keys ({k.size(2)}) than queries "
                         f"({q.size(2)}); with as many, use is_causal=True")
    return _PrefixCausalAttention.apply(q, k, v, scale)
