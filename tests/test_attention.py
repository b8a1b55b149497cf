"""Slice-aware attention's causal mask for a slice over its cached prefix."""

import torch
import torch.nn.functional as F

from megatron_terapipe.runtime.attention import _lower_right_mask
from megatron_terapipe.runtime.context import running_cell
from megatron_terapipe.runtime.kv_cache import KVCache
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
