"""Random plans and batch shapes.

Valid plans are built valid (random compositions of the sequence length and of the micro batch
size): their cells must tile the microbatch exactly and their schedules must pass `validate`.
Invalid plans are valid ones with one fault put in; each must raise the ValueError that names
that fault, with the numbers of that input. Half the generated examples are valid.

A few random valid plans (half of them with their W actions at random places at or after their
backwards) also run on 2 processes against Megatron's no-pipelining run, with every gradient
element and every reported loss within harness.FP32 (see test_equivalence.py).
"""

import random
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_terapipe import TeraPipePlan, build_schedule, validate
from megatron_terapipe.plan import ORDERS
from megatron_terapipe.runtime.batching import slice_batch
from megatron_terapipe.schedule import microbatch_cells
from harness import Case, check_case, spawn
from harness.inputs.draws import w_places


@dataclass(frozen=True)
class Drawn:
    """A plan's constructor arguments and the shape it is validated against."""

    seq_slices: object
    batch_slices: Optional[list]
    order: str
    seq_length: int
    micro_batch_size: int
    multiple_of: int
    defer_wgrad: bool = False
    wgrad_points: tuple = ()

    def build_and_validate(self) -> TeraPipePlan:
        plan = TeraPipePlan(self.seq_slices, batch_slices=self.batch_slices, order=self.order,
                            defer_wgrad=self.defer_wgrad, wgrad_points=self.wgrad_points)
        plan.validate(self.seq_length, self.micro_batch_size, multiple_of=self.multiple_of)
        return plan

    def per_batch_lists(self) -> list[list[int]]:
        """seq_slices as one list per batch slice."""
        if self.seq_slices and isinstance(self.seq_slices[0], list):
            return [list(ts) for ts in self.seq_slices]
        return [list(self.seq_slices) for _ in (self.batch_slices or [None])]


@st.composite
def compositions(draw, total: int, unit: int = 1, max_parts: int = 5) -> list[int]:
    """`total` (a multiple of `unit`) as an ordered sum of positive multiples of `unit`."""
    units = total // unit
    parts = draw(st.integers(1, min(units, max_parts)))
    cuts = []
    if parts > 1:
        cuts = sorted(draw(st.sets(st.integers(1, units - 1), min_size=parts - 1,
                                   max_size=parts - 1)))
    bounds = [0, *cuts, units]
    return [(b - a) * unit for a, b in zip(bounds, bounds[1:])]


@st.composite
def valid_plans(draw) -> Drawn:
    multiple_of = draw(st.sampled_from([1, 1, 2]))
    seq_length = multiple_of * draw(st.integers(1, 12))
    mbs = draw(st.integers(1, 6))
    batch = draw(st.one_of(st.none(), compositions(mbs, max_parts=3)))
    if batch is not None and draw(st.booleans()):
        seq_slices = [draw(compositions(seq_length, multiple_of)) for _ in batch]
    else:
        seq_slices = draw(compositions(seq_length, multiple_of))
    return Drawn(seq_slices, batch, draw(st.sampled_from(ORDERS)), seq_length, mbs, multiple_of)


@settings(max_examples=200, deadline=None)
@given(d=valid_plans())
def test_valid_plans_tile_the_microbatch(d):
    plan = d.build_and_validate()
    seq, mbs = d.seq_length, d.micro_batch_size
    assert plan.seq_length == seq and sum(plan.rows(mbs)) == mbs
    tokens = torch.arange(mbs * seq).view(mbs, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    seen = torch.zeros(mbs, seq, dtype=torch.int)
    cells = microbatch_cells(plan, 0, mbs)
    assert len(cells) == plan.num_cells == sum(len(ts) for ts in d.per_batch_lists())
    for cell in cells:
        part = slice_batch({"tokens": tokens, "attention_mask": mask}, cell, seq, mbs)
        assert torch.equal(part["tokens"], tokens[cell.row_start:cell.row_end,
                                                  cell.token_start:cell.token_end])
        assert part["attention_mask"].shape == (1, 1, cell.tokens, cell.token_end)
        assert cell.tokens % d.multiple_of == 0
        seen[cell.row_start:cell.row_end, cell.token_start:cell.token_end] += 1
    assert torch.all(seen == 1)
    for stages in (1, 3):
        validate(build_schedule(plan, 2, stages, mbs))


# ---- one fault each: (draw, valid plan) -> (faulty plan, the message it must raise) ---------
def _empty_slices(draw, d):
    return replace(d, seq_slices=[]), "TeraPipePlan.seq_slices is empty: give at least one token slice"


def _non_positive_slice(draw, d):
    nested = isinstance(d.seq_slices[0], list)
    lists = d.per_batch_lists() if nested else [list(d.seq_slices)]
    i = draw(st.integers(0, len(lists) - 1))
    j = draw(st.integers(0, len(lists[i]) - 1))
    lists[i][j] = draw(st.integers(-3, 0))
    return (replace(d, seq_slices=lists if nested else lists[0]),
            f"TeraPipePlan.seq_slices must all be positive token counts, got {lists[i]}")


def _non_positive_rows(draw, d):
    rows = list(d.batch_slices or [d.micro_batch_size])
    rows[draw(st.integers(0, len(rows) - 1))] = draw(st.integers(-2, 0))
    return (replace(d, batch_slices=rows),
            f"TeraPipePlan.batch_slices must all be positive, got {rows}")


def _empty_rows(draw, d):
    return (replace(d, batch_slices=[]),
            "TeraPipePlan.batch_slices is empty: use None for no batch slicing")


def _one_list_too_many(draw, d):
    lists = d.per_batch_lists()
    n = len(lists)
    return (replace(d, seq_slices=lists + [lists[0]]),
            f"TeraPipePlan.seq_slices has {n + 1} per-batch-slice lists but there are {n} batch "
            "slices: give one list per entry of batch_slices")


def _empty_list(draw, d):
    lists = d.per_batch_lists()
    i = draw(st.integers(0, len(lists) - 1))
    lists[i] = []
    rows = d.batch_slices or [d.micro_batch_size]
    return (replace(d, seq_slices=lists, batch_slices=rows),
            f"TeraPipePlan: batch slice {i} has no token slices")


def _unequal_sums(draw, d):
    rows = d.batch_slices if d.batch_slices and len(d.batch_slices) > 1 else [1, 1]
    lists = [list(d.per_batch_lists()[0]) for _ in rows]
    lists[draw(st.integers(0, len(rows) - 1))].append(d.multiple_of)
    return (replace(d, seq_slices=lists, batch_slices=rows, micro_batch_size=sum(rows)),
            "TeraPipePlan: every batch slice's token slices must sum to the same sequence "
            f"length, got sums {[sum(ts) for ts in lists]}")


def _mixed(draw, d):
    flat = d.per_batch_lists()[0]
    return (replace(d, seq_slices=[flat[0], flat]),
            "TeraPipePlan.seq_slices mixes numbers and lists")


def _bad_order(draw, d):
    order = draw(st.sampled_from(["zb", "interleaved", "1F1B", ""]))
    return replace(d, order=order), f"TeraPipePlan order must be one of {ORDERS}, got {order!r}"


def _wrong_seq_length(draw, d):
    seq = draw(st.integers(1, 30).filter(lambda s: s != d.seq_length))
    return (replace(d, seq_length=seq),
            f"TeraPipe plan slices sum to {d.seq_length} tokens but seq_length is {seq}: make "
            f"the token slices (--terapipe-slices) sum to {seq}")


def _wrong_rows(draw, d):
    rows = d.batch_slices or [d.micro_batch_size]
    mbs = draw(st.integers(1, 8).filter(lambda m: m != sum(rows)))
    return (replace(d, batch_slices=rows, micro_batch_size=mbs),
            f"TeraPipe plan batch_slices {rows} sum to {sum(rows)} rows but micro_batch_size "
            f"is {mbs}: make batch_slices sum to {mbs}")


def _odd_slices(draw, d):
    lists = [[2 * t for t in ts] for ts in d.per_batch_lists()]  # twice as long, all even
    i = draw(st.integers(0, len(lists) - 1))
    j = draw(st.integers(0, len(lists[i]) - 1))
    lists[i][j: j + 1] = [1, lists[i][j] - 1]  # two odd slices in list i only
    return (replace(d, seq_slices=lists, seq_length=2 * d.seq_length, multiple_of=2,
                    batch_slices=d.batch_slices or [d.micro_batch_size]),
            f"TeraPipe token slices {[1, lists[i][j + 1]]} are not multiples of 2")


def _points_without_deferral(draw, d):
    return (replace(d, wgrad_points=([], [1])),
            "TeraPipePlan.wgrad_points needs defer_wgrad=True")


def _point_out_of_range(draw, d):
    most = max(len(ts) for ts in d.per_batch_lists())
    stage = draw(st.integers(0, 3))
    point = draw(st.sampled_from([0, -1, most, most + 2]))
    return (replace(d, defer_wgrad=True, wgrad_points=tuple([] for _ in range(stage)) + ([point],)),
            f"TeraPipePlan.wgrad_points for stage {stage} name token slices [{point}]; they must "
            f"be between 1 and {most - 1}")


FAULTS = [_empty_slices, _non_positive_slice, _non_positive_rows, _empty_rows,
          _one_list_too_many, _empty_list, _unequal_sums, _mixed, _bad_order, _wrong_seq_length,
          _wrong_rows, _odd_slices, _points_without_deferral, _point_out_of_range]


@settings(max_examples=200, deadline=None)
@given(d=valid_plans(), fault=st.sampled_from(FAULTS), data=st.data())
def test_each_fault_raises_its_own_message(d, fault, data):
    bad, message = fault(data.draw, d)
    with pytest.raises(ValueError) as raised:
        bad.build_and_validate()
    assert str(raised.value).startswith(message), (fault.__name__, bad, str(raised.value))


# ---- random valid plans against Megatron ---------------------------------------------------
def _random_slicing(rng: random.Random, seq_length: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, seq_length), rng.randint(0, 4)))
    bounds = [0, *cuts, seq_length]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _random_cases(n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        mbs = rng.randint(1, 3)
        rows = None
        if mbs > 1 and rng.random() < 0.5:
            cut = rng.randint(1, mbs - 1)
            rows = [cut, mbs - cut]
        if rows is not None and rng.random() < 0.5:
            seq_slices = [_random_slicing(rng, 16) for _ in rows]
        else:
            seq_slices = _random_slicing(rng, 16)
        plan = TeraPipePlan(seq_slices, batch_slices=rows, order=rng.choice(ORDERS))
        microbatches = rng.randint(1, 4) if i % 2 == 0 else rng.randint(2, 4)
        if i % 2:  # W actions anywhere at or after their backwards
            plan = replace(plan, wgrad_after=w_places(rng, plan, microbatches, 2, mbs))
        cases.append(Case(f"random{i}", plan, micro_batch_size=mbs,
                          num_microbatches=microbatches))
    return cases


RANDOM_CASES = _random_cases(8, seed=2024)


def test_random_plans_match_the_baseline():
    results = spawn(2, "harness:run_cases", RANDOM_CASES, timeout=600)
    for case in RANDOM_CASES:
        check_case(results, case)  # its messages name the case
