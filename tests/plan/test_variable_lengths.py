"""Sequence lengths that change between iterations: one plan per length, looked up each call.

Each iteration is compared with Megatron's no-pipelining run at that length (same weights,
same batches): every gradient element and every reported loss value, within harness.FP32
(see tests/equivalence/test_equivalence.py for what that bounds).
"""

import pytest

from megatron_terapipe import PlanTable, TeraPipePlan
from harness import FP32, WorkerError, check_gradients, check_losses, spawn

PLANS = {16: TeraPipePlan([8, 8]), 24: TeraPipePlan([10, 8, 6])}


def test_each_length_matches_the_baseline():
    results = spawn(2, "harness:run_variable_lengths", [16, 24, 16], PLANS,
                    timeout=600)
    last_stages = 0
    for rank, rank_results in enumerate(results):
        assert [r["length"] for r in rank_results] == [16, 24, 16]
        for i, r in enumerate(rank_results):
            where = f"rank {rank}, iteration {i} (length {r['length']})"
            check_gradients(r["grads"], FP32, where)
            if "losses" in r:
                check_losses(r["losses"], r["ref_losses"], FP32, where)
                assert len(r["losses"]) == 2  # one report per microbatch
                last_stages += 1
    assert last_stages == 3  # the last stage reported every iteration


def test_a_length_without_a_plan_names_both_lengths():
    with pytest.raises(ValueError, match=r"no plan for sequence length 20 \(plans exist for lengths \[16, 24\]\)"):
        PlanTable(PLANS).plan_for(20, 2)
    table = PlanTable(planner=lambda seq, mbs: TeraPipePlan.uniform(seq, 2))
    assert table.plan_for(20, 2).seq_slices == (10, 10)
    assert table.plan_for(20, 2) is table.plan_for(20, 2)  # planned once, cached


def test_a_batch_of_another_length_fails_with_both_lengths():
    # A hang would end in spawn's TimeoutError, not this WorkerError.
    with pytest.raises(WorkerError, match="sequences of length 24 but the schedule was called with seq_length=16"):
        spawn(2, "harness:run_with_mismatched_batch", 16, 24, timeout=120)
