"""Slice-aware core attention: a token slice attends to the cached K/V of earlier slices.

The executor announces the cell it is running (`running_cell`). While it runs, every
`SliceAttention` module appends the slice's keys and values to a per-sequence, per-layer cache
and attends over the whole prefix with a bottom-right causal mask.

Gradients, computed once per node (no retain_graph):
- Earlier slices' K/V enter a later slice's attention as detached leaves, so the later slice's
  backward accumulates dK/dV into `leaf.grad` and stops there.
- The slice's own K/V pass through `_LateGrad`, an identity whose backward adds the accumulated
  `leaf.grad` of that slice. Backward runs slices in reverse, so by the time slice t runs its
  backward, every later slice has added its share.
- Recomputation (Megatron's selective `core_attn` or full recompute) re-runs attention inside
  the backward of the same cell; then the module replays the recorded prefix instead of
  appending again, and the same leaves collect the gradients.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from .schedule import Cell

try:  # bottom-right aligned causal bias lets SDPA pick flash/efficient kernels on GPU
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # pragma: no cover - older torch
    causal_lower_right = None


@dataclass
class KVEntry:
    """One slice's keys and values for one layer, as later slices see them."""

    key: torch.Tensor
    value: torch.Tensor


@dataclass
class KVCache:
    """K/V of every live sequence (microbatch, batch slice), per attention layer."""

    entries: dict[tuple[int, int], dict[int, list[KVEntry]]] = field(default_factory=dict)

    def layer_entries(self, cell: Cell, layer: int) -> list[KVEntry]:
        return self.entries.setdefault(cell.sequence_key, {}).setdefault(layer, [])

    def release_slice(self, cell: Cell) -> None:
        """Drop slice `cell.token_slice` of its sequence: its backward has run."""
        layers = self.entries.get(cell.sequence_key)
        if layers is None:
            return
        for lst in layers.values():
            if cell.token_slice < len(lst):
                lst[cell.token_slice] = None  # type: ignore[call-overload]
        if cell.token_slice == 0:
            del self.entries[cell.sequence_key]

    def release_sequence(self, cell: Cell) -> None:
        self.entries.pop(cell.sequence_key, None)

    def live_bytes(self) -> int:
        total = 0
        for layers in self.entries.values():
            for lst in layers.values():
                for e in lst:
                    if e is not None:
                        total += e.key.numel() * e.key.element_size()
                        total += e.value.numel() * e.value.element_size()
        return total

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class ActiveCell:
    cell: Cell
    cache: KVCache
    phase: str  # "forward" or "backward" (recomputation during backward replays the prefix)
    keep_grad: bool  # False in forward_only runs: cache plain tensors


_ACTIVE: Optional[ActiveCell] = None


@contextlib.contextmanager
def running_cell(cell: Cell, cache: KVCache, phase: str, keep_grad: bool = True) -> Iterator[None]:
    """Tell slice-aware modules which cell runs now."""
    global _ACTIVE
    previous = _ACTIVE
    _ACTIVE = ActiveCell(cell, cache, phase, keep_grad)
    try:
        yield
    finally:
        _ACTIVE = previous


def active_cell() -> Optional[ActiveCell]:
    return _ACTIVE


class _LateGrad(torch.autograd.Function):
    """Identity in forward; in backward adds the gradient later slices left on `entry`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        ctx.leaf = leaf
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        extra = ctx.leaf.grad
        ctx.leaf = None
        if extra is not None:
            grad = grad + extra
        return grad, None


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
        active = _ACTIVE
        if active is None:
            return key, value
        cell = active.cell
        entries = active.cache.layer_entries(cell, self.layer_id)
        t = cell.token_slice
        if active.phase == "forward":
            if len(entries) != t:
                raise RuntimeError(
                    f"TeraPipe: token slice {t} of {cell.sequence_key} reached layer "
                    f"{self.layer_number} with {len(entries)} cached slices; slices must run in order")
            if active.keep_grad and torch.is_grad_enabled():
                leaf_k = key.detach().requires_grad_()
                leaf_v = value.detach().requires_grad_()
                entries.append(KVEntry(leaf_k, leaf_v))
                key = _LateGrad.apply(key, leaf_k)
                value = _LateGrad.apply(value, leaf_v)
            elif active.keep_grad:
                # Forward inside a recompute checkpoint (no grad yet): cache leaves now,
                # the replay during backward builds the graph.
                entries.append(KVEntry(key.detach().requires_grad_(), value.detach().requires_grad_()))
            else:
                entries.append(KVEntry(key.detach(), value.detach()))
        else:  # recomputation inside this cell's backward: replay, do not append
            if len(entries) <= t or entries[t] is None:
                raise RuntimeError(
                    f"TeraPipe: recomputation of token slice {t} of {cell.sequence_key} found no cache")
            own = entries[t]
            key = _LateGrad.apply(key, own.key)
            value = _LateGrad.apply(value, own.value)
        prefix = entries[:t]
        if t == 0:
            return key, value
        if any(e is None for e in prefix):
            raise RuntimeError("TeraPipe: an earlier slice's K/V was released before its readers ran")
        key = torch.cat([e.key for e in prefix] + [key], dim=0)
        value = torch.cat([e.value for e in prefix] + [value], dim=0)
        return key, value

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
        else:
            if causal_lower_right is not None:
                bias = causal_lower_right(sq, sk)
            else:  # pragma: no cover
                bias = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout,
                                                 scale=self.softmax_scale)
        # [b, heads, sq, d] -> [sq, b, heads * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)


def rope_offset_pre_hook(module, args, kwargs):
    """Forward pre-hook for RotaryEmbedding: positions of a slice start at its first token."""
    active = _ACTIVE
    if active is not None and active.cell.token_start:
        kwargs = dict(kwargs)
        kwargs["offset"] = active.cell.token_start
        return args, kwargs
    return None


def install_rope_offsets(model: torch.nn.Module) -> int:
    """Hook every rotary embedding in `model` once. Returns how many are hooked."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    try:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    except ImportError:  # pragma: no cover
        MultimodalRotaryEmbedding = ()
    count = 0
    for module in model.modules():
        if MultimodalRotaryEmbedding and isinstance(module, MultimodalRotaryEmbedding):
            raise ValueError(
                "TeraPipe does not support multimodal RoPE (mrope) yet: use "
                "position_embedding_type 'rope' or 'learned_absolute'")
        if isinstance(module, RotaryEmbedding):
            if not getattr(module, "_terapipe_offset_hooked", False):
                module.register_forward_pre_hook(rope_offset_pre_hook, with_kwargs=True)
                module._terapipe_offset_hooked = True
            count += 1
    return count
