"""Random plans and batch shapes: each either runs exactly or raises the documented error."""

import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_terapipe import TeraPipePlan, build_schedule, validate
from megatron_terapipe.runtime.batching import slice_batch
from megatron_terapipe.schedule import microbatch_cells
from harness import Case, spawn

DOCUMENTED = re.compile(
    r"must all be positive|is empty|sum to \d+ tokens but seq_length is \d+|"
    r"sum to \d+ rows but micro_batch_size is \d+|same sequence length|one list per entry|"
    r"not multiples of \d+")


@settings(max_examples=300, deadline=None)
@given(slices=st.lists(st.integers(-2, 9), min_size=0, max_size=5),
       batch=st.one_of(st.none(), st.lists(st.integers(-1, 3), min_size=1, max_size=3)),
       seq_length=st.integers(1, 24), micro_batch_size=st.integers(1, 6),
       multiple_of=st.sampled_from([1, 1, 2]))
def test_validation_and_cell_arithmetic(slices, batch, seq_length, micro_batch_size, multiple_of):
    try:
        plan = TeraPipePlan(seq_slices=slices, batch_slices=batch)
        plan.validate(seq_length, micro_batch_size, multiple_of=multiple_of)
    except ValueError as exc:
        assert DOCUMENTED.search(str(exc)), str(exc)
        return
    # A valid plan: its cells tile the microbatch exactly, and every cell's data has its shape.
    tokens = torch.arange(micro_batch_size * seq_length).view(micro_batch_size, seq_length)
    mask = torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool).triu(1)
    seen = torch.zeros(micro_batch_size, seq_length, dtype=torch.int)
    for cell in microbatch_cells(plan, 0, micro_batch_size):
        part = slice_batch({"tokens": tokens, "attention_mask": mask}, cell, seq_length, micro_batch_size)
        assert part["tokens"].shape == (cell.rows, cell.tokens)
        assert part["attention_mask"].shape == (1, 1, cell.tokens, cell.token_end)
        assert cell.tokens % multiple_of == 0
        seen[cell.row_start:cell.row_end, cell.token_start:cell.token_end] += 1
    assert torch.all(seen == 1)
    for stages in (1, 3):
        validate(build_schedule(plan, 2, stages, micro_batch_size))


def _random_cases(n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        mbs = rng.randint(1, 3)
        rows = None
        if mbs > 1 and rng.random() < 0.5:
            cut = rng.randint(1, mbs - 1)
            rows = [cut, mbs - cut]
        def token_slicing():
            cuts = sorted(rng.sample(range(1, 16), rng.randint(0, 4)))
            bounds = [0] + cuts + [16]
            return [b - a for a, b in zip(bounds, bounds[1:])]
        if rows is not None and rng.random() < 0.5:
            seq_slices = [token_slicing() for _ in rows]
        else:
            seq_slices = token_slicing()
        plan = TeraPipePlan(seq_slices, batch_slices=rows, order=rng.choice(["1f1b", "gpipe"]))
        cases.append(Case(f"random{i}", plan, micro_batch_size=mbs,
                          num_microbatches=rng.randint(1, 4)))
    return cases


def test_random_plans_match_the_baseline():
    cases = _random_cases(8, seed=2024)
    results = spawn(2, "harness:run_cases", cases, timeout=600)
    for case in cases:
        for rank_result in results:
            r = rank_result[case.name]
            assert r["grad_error"] <= 1e-5, (case.plan, r)
            for got, ref in zip(r.get("losses", []), r.get("ref_losses", [])):
                assert got == pytest.approx(ref, rel=1e-5), case.plan
