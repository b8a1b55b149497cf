"""Slice-aware core attention: a token slice attends to the cached K/V of earlier slices.

The executor announces the cell it is running (context.py). While it runs, every
`SliceAttention` module appends the slice's keys and values to a per-sequence, per-layer cache
and attends over the whole prefix with a bottom-right causal mask (on CPU, a slice of over 512
tokens: the prefix and its own causal block, merged: attention/cpu_prefix.py).

Gradients, computed once per node (no retain_graph):
- Each (sequence, layer) of more than one slice has one K/V buffer. A slice writes its K/V at
  its offset and attends over the buffer's prefix (a view: no concatenation, one copy in
  memory). A sequence of one slice needs none: it attends over its own K/V, as Megatron does.
- `_PrefixView`'s backward adds the earlier tokens' share of dK/dV to the buffer's gradient and
  returns the slice's own share plus what later slices added for its tokens. Backward runs
  slices in reverse, so by the time slice t runs its backward, every later slice has added its
  share.
- Recomputation (Megatron's selective `core_attn` or full recompute) re-runs attention inside
  the backward of the same cell; the replay rewrites the same K/V and reads the same prefix.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..context import active_cell
from .kv_cache import KVBuffer
from .cpu_prefix import (prefix_attention_available, prefix_causal_attention,
                               prefix_split_pays)

try:  # bottom-right aligned causal bias lets SDPA pick flash/efficient kernels on GPU
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # pragma: no cover - older torch
    causal_lower_right = None

_PREFIX_ATTENTION = prefix_attention_available()


class _PrefixView(torch.autograd.Function):
    """Write a slice's K (or V) into its sequence buffer; return the buffer's prefix up to it.

    Backward splits the prefix's gradient: earlier tokens' share is added to the buffer's
    gradient (their own slices pick it up later); the slice's own share, plus what later
    slices already added for these tokens, flows back into the slice's graph.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, buf: KVBuffer, which: str, start: int) -> torch.Tensor:
        ctx.buf, ctx.which, ctx.start, ctx.end = buf, which, start, start + x.size(0)
        return getattr(buf, which)[:ctx.end]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        buf, start, end = ctx.buf, ctx.start, ctx.end
        ctx.buf = None
        acc = buf.grad(ctx.which, grad)
        if start:
            acc[:start] += grad[:start]
        return grad[start:end] + acc[start:end], None, None, None


_LAYER_IDS = iter(range(1 << 62))


class SliceAttention(torch.nn.Module):
    """Core attention for the `core_attention` slot of Megatron's self-attention spec.

    Same constructor and forward signature as Megatron's DotProductAttention. Inputs are
    [s, b, heads, head_dim] (key/value may have fewer heads: grouped-query attention); the output
    is [s, b, heads * head_dim]. Outside a TeraPipe cell it is plain causal attention.
    """

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **_unused) -> None:
        super().__init__()
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.layer_id = next(_LAYER_IDS)
        head_dim = config.kv_channels
        # Megatron's query-key layer scaling divides and re-multiplies by the layer number for
        # fp16 range; the softmax input is unchanged, so the plain scale is exact.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.current_max_attn_logits = None

    # -- K/V of the prefix ------------------------------------------------------------------
    def _extend_with_prefix(self, key: torch.Tensor, value: torch.Tensor):
        active = active_cell()
        if active is None:
            return key, value
        cell = active.cell
        if cell.num_token_slices == 1:
            # A whole sequence: no earlier slice to read, no later one to serve, so no buffer
            # (its zeroed gradients and prefix sums): plain causal attention. Its K and V are
            # copied as into a buffer: a view of the QKV projection's output saved for
            # backward would keep all of that output alive.
            return key.contiguous(), value.contiguous()
        buf = active.cache.buffer(cell, self.layer_id, key)
        start = cell.token_start
        if active.phase == "forward":
            if buf.filled != start:
                raise RuntimeError(
                    f"TeraPipe: token slice {cell.token_slice} of {cell.sequence_key} (tokens "
                    f"{start}-{cell.token_end}) reached layer {self.layer_number} with "
                    f"{buf.filled} cached tokens; slices must run in order")
        elif buf.filled < cell.token_end:
            # Recomputation inside this cell's backward replays a slice already written.
            raise RuntimeError(
                f"TeraPipe: recomputation of token slice {cell.token_slice} of "
                f"{cell.sequence_key} found no cached K/V")
        buf.write(start, key, value)
        if active.keep_grad and torch.is_grad_enabled():
            return (_PrefixView.apply(key, buf, "key", start),
                    _PrefixView.apply(value, buf, "value", start))
        # forward_only, or the no-grad forward inside a recompute checkpoint (the replay during
        # backward builds the graph)
        return buf.key[:cell.token_end], buf.value[:cell.token_end]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError(
                "TeraPipe slice attention does not support packed (THD) sequences: "
                "drop packed_seq_params or use Megatron's own schedule")
        if attention_bias is not None:
            raise ValueError("TeraPipe slice attention does not support attention_bias")
        key, value = self._extend_with_prefix(key, value)
        sq, b, heads, head_dim = query.shape
        sk = key.size(0)
        groups = key.size(2)
        if groups != heads:  # grouped-query attention: share each K/V head over its queries
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        dropout = self.dropout_p if self.training else 0.0
        if attention_mask is not None:
            if attention_mask.shape[-2:] != (sq, sk):
                raise ValueError(
                    f"TeraPipe: attention_mask covers {tuple(attention_mask.shape[-2:])} "
                    f"(queries, keys) but this slice has {sq} queries over {sk} keys")
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.bool(),
                                                 dropout_p=dropout, scale=self.softmax_scale)
        elif sk == sq:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                                 scale=self.softmax_scale)
        elif q.device.type != "cpu" and causal_lower_right is not None:
            # GPU: flash/efficient kernels apply the bottom-right causal mask without building it.
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk),
                                                 dropout_p=dropout, scale=self.softmax_scale)
        elif dropout == 0.0 and _PREFIX_ATTENTION and prefix_split_pays(sq):
            # CPU, a long slice: the prefix and the slice's own causal block, merged
            # (attention/cpu_prefix.py), without computing the scores a mask would hide.
            out = prefix_causal_attention(q, k, v, self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=_lower_right_mask(sq, sk, q),
                                                 dropout_p=dropout, scale=self.softmax_scale)
        # [b, heads, sq, d] -> [sq, b, heads * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)


def _lower_right_mask(queries: int, keys: int, like: torch.Tensor) -> torch.Tensor:
    """Additive mask letting the last `queries` positions of `keys` see keys up to their own.

    CPU SDPA materialises a causal bias as a boolean mask and converts it to this on every
    call; building it once per cell saves both steps in every layer but the first."""
    key = (queries, keys, like.dtype, like.device)
    active = active_cell()
    mask = active.masks.get(key) if active is not None else None
    if mask is None:
        mask = torch.full((queries, keys), float("-inf"), dtype=like.dtype, device=like.device)
        mask.triu_(keys - queries + 1)
        if active is not None:
            active.masks[key] = mask
    return mask


def rope_offset_pre_hook(module, args, kwargs):
    """Forward pre-hook for a rotary embedding module whose forward takes `offset` (Megatron's
    RotaryEmbedding: megatron/model/rope.py hooks it): a slice's positions start at its first token."""
    active = active_cell()
    if active is not None and active.cell.token_start:
        kwargs = dict(kwargs)
        kwargs["offset"] = active.cell.token_start
        return args, kwargs
    return None
