"""Cutting microbatches into cells for an unmodified forward_step_func."""

import pytest
import torch

from megatron_terapipe import TeraPipePlan
from megatron_terapipe.runtime.batching import CellData, check_causal_mask, slice_batch
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
