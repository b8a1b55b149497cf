"""Plans as text: compact slice lists and the to-scale picture of one microbatch's cells."""

from __future__ import annotations

import re

import pytest

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner.cli.report import compact_slices, slice_picture


def boxes(row: str) -> list[str]:
    """The insides of a picture row's boxes."""
    return row[row.index("|") + 1:row.rindex("|")].split("|")


def test_compact_slices():
    assert compact_slices([640] * 9 + [576, 512, 512]) == "[640x9, 576, 512x2] (12 slices)"


def test_one_row_boxes_to_scale_and_labelled():
    plan = TeraPipePlan([200, 200, 176, 160, 152, 136])
    (row,) = slice_picture(plan, width=60)
    assert row.startswith("all rows |") and row.endswith("|")
    inside = boxes(row)
    assert [s.strip() for s in inside] == ["200", "200", "176", "160", "152", "136"]
    widths = [len(s) + 1 for s in inside]  # each box: its left edge and its inside
    assert sum(widths) == 60
    assert widths == sorted(widths, reverse=True)  # longer slices, wider boxes
    for w, t in zip(widths, plan.token_slices[0]):
        assert w == pytest.approx(60 * t / 1024, abs=1.0)


def test_one_row_per_batch_slice():
    plan = TeraPipePlan([[512, 512], [1024]], batch_slices=[2, 1])
    rows = slice_picture(plan, width=40)
    assert [r.split("|")[0].strip() for r in rows] == ["2 rows", "1 row"]
    assert [s.strip() for s in boxes(rows[0])] == ["512", "512"]
    assert [s.strip() for s in boxes(rows[1])] == ["1024"]
    assert len({len(r) for r in rows}) == 1  # the rows line up
    assert [r.index("|") for r in rows] == [rows[0].index("|")] * 2


def test_narrow_boxes_lose_their_labels_not_their_place():
    plan = TeraPipePlan([1000] + [8] * 20)
    (row,) = slice_picture(plan, width=60)
    inside = boxes(row)
    assert len(inside) == 21 and inside[0].strip() == "1000"
    assert all(s.strip() in ("", "8") for s in inside[1:])
    assert len(row) == len("all rows ") + 61


def test_many_slices_stay_under_80_columns():
    plan = TeraPipePlan([640] * 9 + [576] * 22 + [512] * 28)  # 59 slices
    (row,) = slice_picture(plan, width=60)
    assert len(row) < 80 and row.count("|") == 60
    (too_many,) = slice_picture(TeraPipePlan([8] * 70), width=60)
    assert re.search(r"70 slices", too_many) and len(too_many) < 80
