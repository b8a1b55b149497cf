"""Sequence lengths that change between iterations: one plan per length, looked up each call."""

import time

import pytest

from megatron_terapipe import PlanTable, TeraPipePlan
from harness import WorkerError, spawn

PLANS = {16: TeraPipePlan([8, 8]), 24: TeraPipePlan([10, 8, 6])}


def test_each_length_matches_the_baseline():
    results = spawn(2, "harness:run_variable_lengths", [16, 24, 16], PLANS,
                    timeout=600)
    for rank_results in results:
        assert [r["length"] for r in rank_results] == [16, 24, 16]
        for r in rank_results:
            assert r["grad_error"] <= 1e-5, r
            if "losses" in r:
                for got, ref in zip(r["losses"], r["ref_losses"]):
                    assert got == pytest.approx(ref, rel=1e-5)


def test_a_length_without_a_plan_names_both_lengths():
    with pytest.raises(ValueError, match=r"no plan for sequence length 20 \(plans exist for lengths \[16, 24\]\)"):
        PlanTable(PLANS).plan_for(20, 2)
    table = PlanTable(planner=lambda seq, mbs: TeraPipePlan.uniform(seq, 2))
    assert table.plan_for(20, 2).seq_slices == (10, 10)
    assert table.plan_for(20, 2) is table.plan_for(20, 2)  # planned once, cached


def test_a_batch_of_another_length_fails_fast():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="sequences of length 24 but the schedule was called with seq_length=16"):
        spawn(2, "harness:run_with_mismatched_batch", 16, 24, timeout=120)
    assert time.monotonic() - start < 60
