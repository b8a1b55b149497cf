"""Megatron's distributed optimizer under TeraPipe, a few training steps against Megatron's own.

Megatron-LM's `--use-distributed-optimizer` (with and without `--overlap-grad-reduce
--overlap-param-gather`) is run by the Megatron-LM matrix (tests/test_megatron_lm_configs.py,
slow); here it runs at the Megatron-Core level in the default suite. On 4 gloo processes
(DP=2 x PP=2), each side builds the same model chunks with Megatron DDP for the distributed
optimizer and Megatron's optimizer (Adam, torch's on CPU), and trains 3 iterations as
Megatron-LM's train_step does (harness/optimizer_runs.py): Megatron's 1F1B (or its
interleaved 1F1B on V=2 chunks) on one side, `forward_backward_terapipe` on the other.

Asserted on every rank, every iteration: every parameter's main_grad after the schedule (the
reduce-scattered buffer) within the equivalence suite's fp32 tolerances (harness.compare.FP32:
max-normalised 1e-5, rtol 1e-4 / atol 1e-6), every reported loss within rtol / atol 1e-6 and
the gradient norm of the optimizer's step (over all ranks) within rel 1e-5;
so iteration 2 and 3 also check that the optimizer steps and the parameter all-gathers gave both
sides the same weights. After the last step every parameter (all-gathered) within rtol 1e-5 /
atol 5e-3 x lr of Megatron's (Adam's steps, see PARAM_ATOL_IN_LR), and changed from the start
(the steps happened). Megatron's distributed optimizer takes Adam only. Two cases clip the
gradients at Megatron-LM's default `--clip-grad 1.0` (every iteration's norm is above it, which
the test checks), on CPU through CPU mode's wrapper of `clip_grad_by_total_norm_fp32`.
"""

from __future__ import annotations

import pytest
import torch

from harness import FP32, TinyGPT, check_gradients, check_losses, spawn
from harness.optimizer_runs import OptimizerCase
from megatron_terapipe import TeraPipePlan

CASES = [
    OptimizerCase("dp2_pp2_1f1b_deferred", TeraPipePlan([6, 10])),
    OptimizerCase("dp2_pp2_gpipe_overlapped_reduce_and_gather",
                  TeraPipePlan([4, 4, 8], order="gpipe", defer_wgrad=False),
                  overlap_grad_reduce=True, overlap_param_gather=True),
    OptimizerCase("dp2_pp2_1f1b_deferred_overlapped_reduce_and_gather_clipped",
                  TeraPipePlan([8, 8]), clip_grad=1.0,
                  overlap_grad_reduce=True, overlap_param_gather=True),
    OptimizerCase("dp2_pp2_v2_overlapped_reduce_and_gather_clipped",
                  TeraPipePlan([8, 8], virtual_stages=2), model=TinyGPT(num_layers=4),
                  clip_grad=1.0, overlap_grad_reduce=True, overlap_param_gather=True),
]
# Adam divides each element's step by that element's running gradient RMS, so a float32
# rounding difference d in a gradient element g moves its step by about lr * d / |g|: elements
# with small gradients carry it into the weights (measured after 3 steps: at most 1.3e-3 * lr,
# 4.4e-4 of the largest change of any parameter). Wrong steps show in the next iteration's
# gradients, checked at FP32 above.
PARAM_RTOL, PARAM_ATOL_IN_LR = 1e-5, 5e-3


@pytest.fixture(scope="module")
def world4():
    return spawn(4, "harness.optimizer_runs:run_optimizer_cases", CASES, timeout=900)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_distributed_optimizer_steps_equal_megatrons(world4, case):
    saw_last = False
    for result in (r[case.name] for r in world4):
        ref, got = result["megatron"], result["terapipe"]
        where = f"{case.name}, rank {result['rank']}"
        assert "DistributedOptimizer" in ref["optimizers"] == got["optimizers"], where
        for i in range(case.iterations):
            check_gradients({n: (g, ref["grads"][i][n]) for n, g in got["grads"][i].items()},
                            FP32, f"{where}, iteration {i}")
            assert got["grad_norms"][i] == pytest.approx(ref["grad_norms"][i], rel=1e-5) != 0, where
            assert got["grad_norms"][i] > case.clip_grad, f"{where}: clipping did not act"
            if result["last_stage"]:
                check_losses(got["losses"][i], ref["losses"][i], FP32, f"{where}, iteration {i}")
        saw_last |= result["last_stage"]
        assert got["params"].keys() == ref["params"].keys(), where
        for name, param in got["params"].items():
            torch.testing.assert_close(param, ref["params"][name], rtol=PARAM_RTOL,
                                       atol=PARAM_ATOL_IN_LR * case.lr,
                                       msg=lambda m, n=name: f"{where}: {n}: {m}")
        still = [n for n, p in got["params"].items() if torch.equal(p, got["start"][n])]
        assert not still, f"{where}: the steps left {still} unchanged"
    assert saw_last, case.name
