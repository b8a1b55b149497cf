"""Megatron's distributed optimizer (and, with bf16, its 16-bit optimizer) under TeraPipe, a few
training steps against Megatron's own.

Megatron-LM's `--use-distributed-optimizer` (with and without `--overlap-grad-reduce
--overlap-param-gather`) is run by the Megatron-LM matrix (tests/glue/test_megatron_lm_configs.py,
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
Two cases run as Megatron-LM's `--bf16` does (bf16 weights in a Float16Module, fp32 gradient
buffers): with Megatron's 16-bit optimizer (`Float16OptimizerWithFloat16Params`, fp32 main
weights) and with the distributed optimizer; their tolerances are bf16's (the comment above
BF16_GRAD_NORM_REL says which). Megatron-LM's `--bf16` itself is a row of the Megatron-LM matrix.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness import BF16, FP32, TinyGPT, check_gradients, check_losses
from harness.runs.optimizer_runs import OptimizerCase
from megatron_terapipe import TeraPipePlan

BF16_MODEL = TinyGPT(bf16=True, params_dtype=torch.bfloat16)
# --pipeline-schedule auto's trials (MeasuredChoice) switch schedules between iterations:
# Megatron's 1F1B, TeraPipe, Megatron's, TeraPipe, then the one measured faster; every
# iteration equal to Megatron's alone
SWITCH = OptimizerCase("dp2_pp2_measured_choice_switching_schedules", TeraPipePlan([6, 10]),
                       iterations=5, switch=True)
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
    # Megatron-LM's --bf16: Float16Module, fp32 gradient buffers, Megatron's 16-bit optimizer
    # (fp32 main weights) or its distributed optimizer; on CPU through CPU mode's wrappers
    OptimizerCase("dp2_pp2_bf16_16bit_optimizer_clipped", TeraPipePlan([8, 8]),
                  model=BF16_MODEL, clip_grad=1.0, distributed_optimizer=False),
    OptimizerCase("dp2_pp2_bf16_distributed_optimizer_overlapped_clipped",
                  TeraPipePlan([4, 4, 8], order="gpipe"), model=BF16_MODEL, clip_grad=1.0,
                  overlap_grad_reduce=True, overlap_param_gather=True),
    SWITCH,
]
# Adam divides each element's step by that element's running gradient RMS, so a float32
# rounding difference d in a gradient element g moves its step by about lr * d / |g|: elements
# with small gradients carry it into the weights (measured after 3 steps: at most 1.3e-3 * lr,
# 4.4e-4 of the largest change of any parameter). Wrong steps show in the next iteration's
# gradients, checked at FP32 above.
PARAM_RTOL, PARAM_ATOL_IN_LR = 1e-5, 5e-3


#: What the world2 / world4 fixtures run (conftest.py): WORKER on each world's cases.
WORKER = "harness.runs.optimizer_runs:run_optimizer_cases"
WORLDS = {4: CASES}


# bf16 (Megatron-LM's --bf16): the first iteration's gradients at the bf16 tolerance (BF16,
# measured 1.1e-2 to 1.5e-2 max-normalised). After a step the two sides' bf16 weights round
# apart (one ulp is 2**-8 to 2**-7 of a weight) and later gradients with them (measured up to
# 0.14), so later iterations check the losses (rel 2e-3, measured at most 2.6e-4; the first
# iteration's at BF16, measured 7.1e-5) and the gradient norm (rel 5e-3, measured at most
# 9.8e-4). After the last step each tensor's update (weights after minus before) against
# Megatron's, where Adam's division by each element's gradient RMS lets rounding steer the
# steps of small-gradient elements: the norm of the difference within BF16_UPDATE_REL of
# Megatron's update (measured at most 0.18; one tensor's gradient of the wrong sign in the last
# step alone: 0.37) and the two updates' norms within BF16_UPDATE_NORM (measured 0.997 to
# 1.016; one step fewer: about 2/3).
BF16_GRAD_NORM_REL = 5e-3
BF16_LATER = replace(BF16, loss_rtol=2e-3)
BF16_UPDATE_REL, BF16_UPDATE_NORM = 0.25, (0.9, 1.1)


def key_bias(name: str, model: TinyGPT, size: int) -> torch.Tensor:
    """Mask of the key biases in a linear_qkv bias (per query group: queries, key, value). A
    key bias adds the same score to all of a query's keys, which the softmax cancels: its
    gradient is rounding noise (measured 1e-3 to 3e-3 of the bias's largest), which Adam's
    division by the gradient's RMS turns into whole steps of either sign. Those elements are
    held to the bound any Adam step keeps: 2 x lr per step, plus one bf16 ulp."""
    mask = torch.zeros(size, dtype=torch.bool)
    if name.endswith("linear_qkv.bias"):
        groups = model.num_query_groups or model.num_attention_heads
        head = model.hidden_size // model.num_attention_heads
        per_group = size // groups
        for g in range(groups):
            mask[g * per_group + per_group - 2 * head:g * per_group + per_group - head] = True
    return mask


def check_bf16_update(case, name: str, start, got, expected, where: str) -> None:
    noise = key_bias(name, case.model, expected.numel()).view_as(expected)
    bound = 2 * case.iterations * case.lr + expected.abs() * 2 ** -7
    assert ((got - expected).abs() <= bound)[noise].all(), f"{where}: {name}'s key biases"
    mine, theirs = (got - start)[~noise], (expected - start)[~noise]
    rel = float((mine - theirs).norm() / theirs.norm())
    ratio = float(mine.norm() / theirs.norm())
    low, high = BF16_UPDATE_NORM
    assert rel <= BF16_UPDATE_REL and low <= ratio <= high, (
        f"{where}: {name}: update off by {rel:.3f} of Megatron's (at most {BF16_UPDATE_REL}), "
        f"its norm {ratio:.3f} of Megatron's (within {BF16_UPDATE_NORM})")


def check_iteration(case, got, ref, i: int, last_stage: bool, where: str) -> None:
    bf16 = case.model.bf16
    if i == 0 or not bf16:
        check_gradients({n: (g, ref["grads"][i][n]) for n, g in got["grads"][i].items()},
                        BF16 if bf16 else FP32, f"{where}, iteration {i}")
    rel = BF16_GRAD_NORM_REL if bf16 else 1e-5
    assert got["grad_norms"][i] == pytest.approx(ref["grad_norms"][i], rel=rel) != 0, where
    assert got["grad_norms"][i] > case.clip_grad, f"{where}: clipping did not act"
    if last_stage:
        loss_tolerance = (BF16 if i == 0 else BF16_LATER) if bf16 else FP32
        check_losses(got["losses"][i], ref["losses"][i], loss_tolerance, f"{where}, iteration {i}")


def check_weights(case, got, ref, where: str) -> None:
    assert got["params"].keys() == ref["params"].keys(), where
    assert all(torch.equal(p, ref["start"][n]) for n, p in got["start"].items()), where
    for name, param in got["params"].items():
        expected = ref["params"][name]
        if case.model.bf16:
            check_bf16_update(case, name, ref["start"][name], param, expected, where)
        else:
            torch.testing.assert_close(param, expected, rtol=PARAM_RTOL,
                                       atol=PARAM_ATOL_IN_LR * case.lr,
                                       msg=lambda m, n=name: f"{where}: {n}: {m}")
    still = [n for n, p in got["params"].items() if torch.equal(p, got["start"][n])]
    assert not still, f"{where}: the steps left {still} unchanged"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_optimizer_steps_equal_megatrons(world4, case):
    optimizer = ("DistributedOptimizer" if case.distributed_optimizer
                 else "Float16OptimizerWithFloat16Params")
    saw_last = False
    for result in (r[case.name] for r in world4):
        ref, got = result["megatron"], result["terapipe"]
        where = f"{case.name}, rank {result['rank']}"
        assert optimizer in ref["optimizers"] == got["optimizers"], where
        for i in range(case.iterations):
            check_iteration(case, got, ref, i, result["last_stage"], where)
        check_weights(case, got, ref, where)
        saw_last |= result["last_stage"]
    assert saw_last, case.name


def test_measured_choice_switched_schedules_alike_on_every_rank(world4):
    ran = [r[SWITCH.name]["terapipe"]["ran"] for r in world4]
    assert ran[0][:4] == ["Megatron", "TeraPipe", "Megatron", "TeraPipe"], ran[0]
    assert ran[0][4] in ("Megatron", "TeraPipe") and all(r == ran[0] for r in ran), ran
