"""CPU prefix attention (runtime/prefix_attention.py): a slice's attention over its cached
prefix as two flash blocks merged by log-sum-exps equals SDPA with the bottom-right causal
mask, in output and in every input's gradient; the slice attention takes it on CPU without
dropout, the masked call with dropout."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import megatron_terapipe.runtime.attention as attention_module
from megatron_terapipe.runtime.attention import SliceAttention, _lower_right_mask
from megatron_terapipe.runtime.context import running_cell
from megatron_terapipe.runtime.kv_cache import KVCache
from megatron_terapipe.runtime.prefix_attention import (prefix_attention_available,
                                                        prefix_causal_attention)
from megatron_terapipe.schedule import Cell

pytestmark = pytest.mark.skipif(not prefix_attention_available(),
                                reason="this torch has no CPU flash attention kernel")

# (dtype, atol on values of order 1): the masked SDPA call is the reference
TOLERANCES = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 3e-2}


def _inputs(queries: int, keys: int, dtype: torch.dtype, batch: int = 2, heads: int = 3,
            head_dim: int = 16):
    """q, k, v as the slice attention passes them: [s, b, h, d] tensors permuted to
    [b, h, s, d] (not contiguous), leaves that require grad."""
    gen = torch.Generator().manual_seed(queries * 1000 + keys)
    shapes = ((queries, batch, heads, head_dim), (keys, batch, heads, head_dim),
              (keys, batch, heads, head_dim))
    leaves = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
              for s in shapes]
    return leaves, [t.permute(1, 2, 0, 3) for t in leaves]


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("queries,keys", [(1, 2), (1, 9), (4, 8), (5, 17), (64, 256), (63, 64)])
def test_equals_sdpa_with_the_bottom_right_mask_in_output_and_gradients(dtype, queries, keys):
    leaves, (q, k, v) = _inputs(queries, keys, dtype)
    scale = 0.3
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64).to(dtype)
    ours = prefix_causal_attention(q, k, v, scale)
    our_grads = torch.autograd.grad(ours, leaves, grad)
    mask = _lower_right_mask(queries, keys, q)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    reference_grads = torch.autograd.grad(reference, leaves, grad)
    atol = TOLERANCES[dtype]
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, reference, rtol=0, atol=atol)
    for name, mine, theirs in zip("qkv", our_grads, reference_grads):
        assert theirs.abs().max() > 0.01, name  # every input gets a gradient worth comparing
        torch.testing.assert_close(mine, theirs, rtol=0, atol=atol * 4, msg=name)


def test_the_last_query_sees_every_key_and_the_first_none_of_the_slice_after_it():
    """A value put only on the slice's last key reaches its last query and no other."""
    leaves, (q, k, v) = _inputs(4, 12, torch.float64, batch=1, heads=1)
    with torch.no_grad():
        leaves[2].zero_()
        leaves[2][-1] = 1.0
    out = prefix_causal_attention(q, k, v, 0.25)
    assert (out[0, 0, :3] == 0).all() and (out[0, 0, 3] > 0).all()


def test_needs_more_keys_than_queries():
    _, (q, k, v) = _inputs(4, 4, torch.float32)
    with pytest.raises(ValueError, match="more keys .4. than queries .4."):
        prefix_causal_attention(q, k, v, 0.25)


def _second_slice_attention(dropout: float, monkeypatch) -> list[str]:
    """Run the second of two slices through SliceAttention and say which attention it took."""
    taken = []
    original = attention_module.prefix_causal_attention
    monkeypatch.setattr(attention_module, "prefix_causal_attention",
                        lambda *a: taken.append("prefix") or original(*a))
    monkeypatch.setattr(attention_module, "_lower_right_mask",
                        lambda *a: taken.append("masked") or _lower_right_mask(*a))
    module = SliceAttention(SimpleNamespace(kv_channels=8, attention_dropout=dropout), 1)
    cache = KVCache()
    for cell in (Cell(0, 0, 0, 0, 1, 0, 8, 2), Cell(0, 0, 1, 0, 1, 8, 4, 2)):
        q, k, v = (torch.randn(cell.tokens, 1, 2, 8) for _ in range(3))
        with running_cell(cell, cache, "forward"):
            module(q, k, v, None)
    return taken


def test_slice_attention_takes_it_on_cpu_and_keeps_the_mask_for_dropout(monkeypatch):
    assert _second_slice_attention(0.0, monkeypatch) == ["prefix"]
    assert _second_slice_attention(0.1, monkeypatch) == ["masked"]
