"""Slice-aware attention: the causal mask for a slice over its cached prefix, and a sequence
of one slice without K/V buffers."""

import torch
import torch.nn.functional as F

from megatron_terapipe.runtime.attention.slice_attention import _lower_right_mask
from megatron_terapipe.runtime.context import running_cell
from megatron_terapipe.runtime.attention.kv_cache import KVCache
from megatron_terapipe.schedule import Cell


def _reference(queries: int, keys: int) -> torch.Tensor:
    """Query i (of the last `queries` positions) sees keys up to its own position."""
    positions = torch.arange(keys - queries, keys)[:, None]
    return torch.arange(keys)[None, :] <= positions


def test_lower_right_mask_lets_each_query_see_the_prefix_and_itself():
    for queries, keys in ((1, 1), (3, 3), (2, 7), (64, 256)):
        mask = _lower_right_mask(queries, keys, torch.empty(0))
        assert torch.equal(mask == 0, _reference(queries, keys))
        assert torch.isneginf(mask[~_reference(queries, keys)]).all()


def test_sdpa_with_the_mask_equals_full_causal_attention_on_the_last_rows():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    last = F.scaled_dot_product_attention(q[:, :, 8:], k, v, attn_mask=_lower_right_mask(4, 12, q))
    torch.testing.assert_close(last, full[:, :, 8:], rtol=0, atol=1e-6)


def test_mask_is_built_once_per_cell_and_dropped_with_it():
    like = torch.empty(0)
    cell = Cell(microbatch=0, batch_slice=0, token_slice=1, row_start=0, rows=1, token_start=4,
                tokens=4, num_token_slices=2)
    with running_cell(cell, KVCache(), "forward"):
        first = _lower_right_mask(4, 8, like)
        assert _lower_right_mask(4, 8, like) is first  # the next layer reuses it
        assert _lower_right_mask(4, 8, like.double()) is not first  # per dtype
    with running_cell(cell, KVCache(), "forward"):
        assert _lower_right_mask(4, 8, like) is not first


def test_a_sequence_of_one_slice_takes_no_k_v_buffer_and_two_slices_agree():
    """A whole sequence attends over its own K/V with no buffer (no slice before it to read, none
    after it to serve): plain causal attention's output and gradients, and an empty cache. The
    same sequence in two slices goes through the buffers and gets the same."""
    from types import SimpleNamespace

    from megatron_terapipe.runtime.attention.slice_attention import SliceAttention

    torch.manual_seed(0)
    attention = SliceAttention(SimpleNamespace(kv_channels=8, attention_dropout=0.0), 1)
    leaves = [torch.randn(12, 1, 2, 8, requires_grad=True) for _ in range(3)]
    grad = torch.randn(12, 1, 16)
    plain = attention(*leaves, None)  # outside a cell: ordinary causal attention
    plain_grads = torch.autograd.grad(plain, leaves, grad)

    cache = KVCache()
    whole = Cell(0, 0, 0, 0, 1, 0, 12, 1)
    with running_cell(whole, cache, "forward"):
        out = attention(*leaves, None)
    assert len(cache) == 0 and cache.live_bytes() == 0
    with running_cell(whole, cache, "backward"):
        grads = torch.autograd.grad(out, leaves, grad)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    for g, p in zip(grads, plain_grads):
        torch.testing.assert_close(g, p, rtol=0, atol=0)

    spans = (slice(0, 8), slice(8, 12))
    parts = [[t.detach()[span].clone().requires_grad_() for t in leaves] for span in spans]
    cells = [Cell(0, 0, 0, 0, 1, 0, 8, 2), Cell(0, 0, 1, 0, 1, 8, 4, 2)]
    outs = []
    for cell, inputs in zip(cells, parts):
        with running_cell(cell, cache, "forward"):
            outs.append(attention(*inputs, None))
    assert len(cache) == 1  # the sliced sequence's buffers
    sliced_grads = [None, None]
    for i in (1, 0):  # backward runs the slices in reverse
        with running_cell(cells[i], cache, "backward"):
            sliced_grads[i] = torch.autograd.grad(outs[i], parts[i], grad[spans[i]])
    cache.release_sequence(cells[0])
    torch.testing.assert_close(torch.cat(outs), plain, rtol=0, atol=1e-6)
    for i, p in enumerate(plain_grads):
        torch.testing.assert_close(torch.cat([sliced_grads[0][i], sliced_grads[1][i]]), p,
                                   rtol=0, atol=1e-6)
