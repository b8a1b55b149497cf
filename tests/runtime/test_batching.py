"""Cutting microbatches into cells for an unmodified forward_step_func."""

import pytest
import torch

from megatron_terapipe import TeraPipePlan
from megatron_terapipe.runtime.batching import (CausalCut, CellData, check_causal_mask,
                                                is_plain_causal, plain_causal_mask, slice_batch)
from megatron_terapipe.runtime.memory.buffer_pool import BufferPool
from megatron_terapipe.schedule import microbatch_cells


def _batch(b=3, s=8):
    tokens = torch.arange(b * s).view(b, s)
    return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s),
            "attention_mask": torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)}


def test_cells_cover_every_row_and_token_once():
    plan = TeraPipePlan([[2, 6], [3, 3, 2]], batch_slices=[1, 2])
    batch = _batch()
    seen = torch.zeros(3, 8, dtype=torch.int)
    for cell in microbatch_cells(plan, 0, 3):
        part = slice_batch(batch, cell, 8, 3)
        assert part["tokens"].shape == (cell.rows, cell.tokens)
        assert torch.equal(part["position_ids"][0], torch.arange(cell.token_start, cell.token_end))
        # the mask keeps the cell's query rows and every key up to the cell's end
        assert part["attention_mask"].shape == (1, 1, cell.tokens, cell.token_end)
        assert torch.equal(part["attention_mask"][0, 0],
                           batch["attention_mask"][0, 0, cell.token_start:cell.token_end, :cell.token_end])
        seen[cell.row_start:cell.row_end, cell.token_start:cell.token_end] += 1
    assert torch.all(seen == 1)


def test_tuple_batches_are_sliced_too():
    b = _batch()
    batch = (b["tokens"], b["labels"], b["loss_mask"], b["attention_mask"], b["position_ids"])
    cell = microbatch_cells(TeraPipePlan([5, 3]), 0, 3)[1]
    part = slice_batch(batch, cell, 8, 3)
    assert isinstance(part, tuple) and part[0].shape == (3, 3) and part[3].shape == (1, 1, 3, 8)


def test_each_microbatch_is_read_once():
    reads = []

    def source():
        for i in range(2):
            reads.append(i)
            yield _batch()

    data = CellData(source(), 8, 3)
    cells = microbatch_cells(TeraPipePlan([4, 4]), 0, 3) + microbatch_cells(TeraPipePlan([4, 4]), 1, 3)
    for cell in cells:
        it = data.iterator_for(cell)
        next(it)
        with pytest.raises(StopIteration):
            next(it)
    assert reads == [0, 1]


def test_non_causal_mask_is_rejected():
    check_causal_mask(_batch(), 8)
    bad = _batch()
    bad["attention_mask"] = torch.zeros(1, 1, 8, 8, dtype=torch.bool)  # full attention
    with pytest.raises(ValueError, match="not causal"):
        check_causal_mask(bad, 8)
    wrong = _batch()
    wrong["attention_mask"] = torch.ones(1, 1, 4, 4, dtype=torch.bool).triu(1)
    with pytest.raises(ValueError, match="expected"):
        check_causal_mask(wrong, 8)


def test_plain_causal_equals_the_elementwise_comparison():
    # masks of every cut (first query, queries, keys), bool and float, with and without one
    # flipped entry: the one-pass comparison agrees with building the expected mask
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        n = int(torch.randint(1, 41, (1,), generator=g))  # multiples of 8: 8 bytes at a time
        first = int(torch.randint(0, n, (1,), generator=g))
        queries = int(torch.randint(1, n - first + 1, (1,), generator=g))
        keys = first + queries if bool(torch.randint(0, 2, (1,), generator=g)) else n
        rows = int(torch.randint(1, 3, (1,), generator=g))
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)[first:first + queries, :keys]
        mask = mask.expand(rows, 1, queries, keys).clone()
        if bool(torch.rand(1, generator=g) < 0.6):
            flip = int(torch.randint(0, mask.numel(), (1,), generator=g))
            mask.view(-1)[flip] = ~mask.view(-1)[flip]
        expected = bool((mask == torch.ones(queries, keys, dtype=torch.bool).triu(first + 1)).all())
        assert is_plain_causal(mask, first) == expected
        assert is_plain_causal(mask.float(), first) == expected
        assert is_plain_causal(mask[:, :, :, :].transpose(-1, -2).transpose(-1, -2), first) == expected


def test_check_causal_mask_says_whether_the_mask_is_the_plain_one():
    assert check_causal_mask(_batch(), 8) is True
    assert check_causal_mask({"tokens": torch.zeros(3, 8)}, 8) is True
    more = _batch()
    more["attention_mask"] = more["attention_mask"].clone()
    more["attention_mask"][..., 5, 0] = True  # causal, but masks a past token too: kept
    assert check_causal_mask(more, 8) is False


def test_cells_of_a_plain_causal_microbatch_say_so():
    # CellData checks the microbatch's mask once; its cells carry the answer (CausalCut), so
    # per-cell readers (Megatron-LM's CellBatches) need not look at the mask again
    plan = TeraPipePlan([3, 5])
    other = _batch()
    other["attention_mask"] = other["attention_mask"].clone()
    other["attention_mask"][..., 5, 0] = True
    data = CellData(iter([_batch(), other]), 8, 3)
    for microbatch, plain in ((0, True), (1, False)):
        for cell in microbatch_cells(plan, microbatch, 3):
            part = next(data.iterator_for(cell))
            assert isinstance(part, CausalCut) is plain
            assert part["attention_mask"].shape == (1, 1, cell.tokens, cell.token_end)


def test_staging_keeps_no_copy_of_a_plain_causal_mask():
    # with a pool (the executor's), a microbatch's tensors are copied to fixed addresses; a mask
    # found plain causal is replaced by the kept causal mask instead (same values, no copy), a
    # mask that is not plain is copied like any other tensor, and so is a float causal mask
    other = _batch()
    other["attention_mask"] = other["attention_mask"].clone()
    other["attention_mask"][..., 5, 0] = True
    floats = _batch()
    floats["attention_mask"] = floats["attention_mask"].float()
    batches = [_batch(), other, floats]
    data = CellData(iter([dict(b) for b in batches]), 8, 3, pool=BufferPool())
    kept = plain_causal_mask(8, torch.device("cpu"))
    for microbatch, batch in enumerate(batches):
        cell = microbatch_cells(TeraPipePlan([8]), microbatch, 3)[0]
        part = next(data.iterator_for(cell))
        for key, value in batch.items():
            assert torch.equal(part[key], value), key
            assert part[key].data_ptr() != value.data_ptr(), key  # staged or kept: never the source's
        uses_kept = part["attention_mask"].data_ptr() == kept.data_ptr()
        assert uses_kept is (microbatch == 0)
    staged_masks = [t for t in data.staged if t.dim() == 4]
    assert len(staged_masks) == 2  # the other mask and the float one
