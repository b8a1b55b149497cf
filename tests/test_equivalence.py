"""TeraPipe against Megatron's no-pipelining baseline: losses and every parameter gradient.

Each world (2 or 4 gloo processes) runs its cases once (module fixture); each case compares, on
every rank, the TeraPipe run with `forward_backward_no_pipelining` on the full model built with
Megatron's own local spec, from the same weights and data.
"""

import dataclasses

import pytest
import torch

from megatron_terapipe import TeraPipePlan
from harness import BF16, Case, TinyGPT, check_case, spawn

UNEVEN = TeraPipePlan(seq_slices=[5, 7, 4])

CASES_2 = [
    Case("pp2_1f1b_uneven_more_mb", UNEVEN, num_microbatches=3),
    Case("pp2_gpipe_uneven_more_mb", TeraPipePlan([5, 7, 4], order="gpipe"), num_microbatches=3),
    Case("pp2_1f1b_one_slice_fewer_mb", TeraPipePlan([16]), num_microbatches=1),
    Case("pp2_gpipe_learned_abs", TeraPipePlan([3, 13], order="gpipe"), num_microbatches=1,
         model=TinyGPT(position_embedding_type="learned_absolute")),
    Case("pp2_1f1b_learned_abs", UNEVEN, model=TinyGPT(position_embedding_type="learned_absolute")),
    Case("pp2_1f1b_batch_slices_own_tokens", TeraPipePlan([[8, 8], [4, 4, 8]], batch_slices=[1, 2]),
         micro_batch_size=3, num_microbatches=2),
    Case("pp2_gpipe_batch_slices", TeraPipePlan([8, 8], batch_slices=[2, 1], order="gpipe"),
         micro_batch_size=3, num_microbatches=4),
    Case("pp2_dataset_causal_mask", UNEVEN, with_mask=True),
    Case("pp2_legacy_two_tuple_loss", UNEVEN, legacy_loss=True),
    Case("pp2_per_token_loss", UNEVEN, model=TinyGPT(calculate_per_token_loss=True)),
    Case("pp2_grouped_query_attention", UNEVEN, model=TinyGPT(num_query_groups=2)),
    Case("pp2_tied_embeddings_ddp", UNEVEN, model=TinyGPT(untie=False), ddp=True),
    Case("pp2_selective_recompute", UNEVEN,
         model=TinyGPT(recompute_granularity="selective", recompute_modules=("core_attn",))),
    Case("pp2_full_recompute", TeraPipePlan([5, 7, 4], order="gpipe"),
         model=TinyGPT(recompute_granularity="full")),
    Case("pp2_forward_only", UNEVEN, forward_only=True),
    # Megatron's own P2PCommunicator (the CUDA path) with its fused send/receive calls.
    Case("pp2_megatron_p2p_1f1b", UNEVEN, transport="megatron", num_microbatches=4),
    Case("pp2_megatron_p2p_gpipe", TeraPipePlan([5, 7, 4], order="gpipe"), transport="megatron"),
    # bf16 through Megatron's Float16Module: both sides round differently once slices change
    # the summation order, so the bound is bf16's (8 mantissa bits), not fp32's.
    Case("pp2_bf16_float16module", UNEVEN, model=TinyGPT(bf16=True, params_dtype=torch.bfloat16),
         tolerance=BF16),
]

CASES_4 = [
    Case("pp4_1f1b_more_mb", UNEVEN, pp=4, num_microbatches=5),
    Case("pp4_gpipe_fewer_mb", TeraPipePlan([8, 4, 4], order="gpipe"), pp=4, num_microbatches=2),
    Case("pp4_1f1b_batch_slices", TeraPipePlan([4, 12], batch_slices=[1, 1]), pp=4,
         num_microbatches=3),
    Case("pp4_megatron_p2p_1f1b", TeraPipePlan([8, 8]), pp=4, num_microbatches=5,
         transport="megatron"),
    Case("tp2_pp2_1f1b", TeraPipePlan([6, 6, 4]), tp=2, pp=2),
    Case("tp2_pp2_gpipe_rope_gqa", TeraPipePlan([2, 14], order="gpipe"), tp=2, pp=2,
         model=TinyGPT(num_query_groups=2)),
    # Sequence parallelism: slices are multiples of TP, stage transfers carry tokens / TP.
    Case("tp2_pp2_sequence_parallel", TeraPipePlan([6, 6, 4]), tp=2, pp=2, ddp=True,
         model=TinyGPT(sequence_parallel=True)),
    Case("tp2_pp2_sequence_parallel_gpipe_learned_abs", TeraPipePlan([2, 10, 4], order="gpipe"),
         tp=2, pp=2, ddp=True,
         model=TinyGPT(sequence_parallel=True, position_embedding_type="learned_absolute")),
    Case("dp2_pp2_ddp_1f1b", UNEVEN, pp=2, ddp=True, num_microbatches=2),
    Case("dp2_pp2_ddp_gpipe", TeraPipePlan([5, 7, 4], order="gpipe"), pp=2, ddp=True,
         num_microbatches=3),
]


# Deferred weight gradients (W actions): the same comparison, and the layers must really defer.
def deferred(plan: TeraPipePlan) -> TeraPipePlan:
    return dataclasses.replace(plan, defer_wgrad=True)


DEFERRED = deferred(TeraPipePlan([5, 7, 4]))

DEFERRED_2 = [
    Case("w_pp2_1f1b_uneven", DEFERRED, num_microbatches=3),
    Case("w_pp2_gpipe_fewer_mb", deferred(TeraPipePlan([5, 7, 4], order="gpipe")), num_microbatches=1),
    Case("w_pp2_one_slice", deferred(TeraPipePlan([16])), num_microbatches=2),
    Case("w_pp2_early_w", TeraPipePlan([5, 3, 4, 4], defer_wgrad=True, wgrad_points=[[3, 1], [2]]),
         num_microbatches=2),
    Case("w_pp2_batch_slices_own_tokens",
         deferred(TeraPipePlan([[8, 8], [4, 4, 8]], batch_slices=[1, 2])), micro_batch_size=3),
    Case("w_pp2_tied_embeddings_ddp_overlap", DEFERRED, model=TinyGPT(untie=False), ddp=True,
         overlap_grad_reduce=True),
    Case("w_pp2_per_token_loss", DEFERRED, model=TinyGPT(calculate_per_token_loss=True)),
    Case("w_pp2_selective_recompute", DEFERRED,
         model=TinyGPT(recompute_granularity="selective", recompute_modules=("core_attn",))),
    Case("w_pp2_full_recompute", deferred(TeraPipePlan([5, 7, 4], order="gpipe")),
         model=TinyGPT(recompute_granularity="full")),
    Case("w_pp2_megatron_p2p", DEFERRED, transport="megatron", num_microbatches=4),
    Case("w_pp2_bf16_float16module", DEFERRED,
         model=TinyGPT(bf16=True, params_dtype=torch.bfloat16), tolerance=BF16),
]

DEFERRED_4 = [
    Case("w_pp4_1f1b_more_mb", DEFERRED, pp=4, num_microbatches=5),
    Case("w_pp4_early_w_gpipe", TeraPipePlan([5, 7, 4], order="gpipe", defer_wgrad=True,
                                             wgrad_points=[[2], [1, 2], [], [1]]), pp=4,
         num_microbatches=2),
    Case("w_pp4_early_w_megatron_p2p",
         TeraPipePlan([5, 3, 4, 4], defer_wgrad=True, wgrad_points=[[3, 1], [2], [1, 2, 3], [1]]),
         pp=4, transport="megatron", num_microbatches=3),
    Case("w_tp2_pp2_1f1b", deferred(TeraPipePlan([6, 6, 4])), tp=2, pp=2),
    Case("w_tp2_pp2_sequence_parallel_ddp", deferred(TeraPipePlan([6, 6, 4])), tp=2, pp=2,
         ddp=True, model=TinyGPT(sequence_parallel=True)),
    Case("w_dp2_pp2_ddp_overlap", DEFERRED, pp=2, ddp=True, overlap_grad_reduce=True,
         num_microbatches=2),
    Case("w_dp2_pp2_ddp_overlap_early_w",
         TeraPipePlan([5, 7, 4], defer_wgrad=True, wgrad_points=[[2, 1], [1]]), pp=2, ddp=True,
         overlap_grad_reduce=True, num_microbatches=2),
]

CASES_2 += DEFERRED_2
CASES_4 += DEFERRED_4


@pytest.fixture(scope="module")
def world2():
    return spawn(2, "harness:run_cases", CASES_2, timeout=900)


@pytest.fixture(scope="module")
def world4():
    return spawn(4, "harness:run_cases", CASES_4, timeout=900)


@pytest.mark.parametrize("case", CASES_2, ids=[c.name for c in CASES_2])
def test_two_processes(world2, case):
    check_case(world2, case)


@pytest.mark.parametrize("case", CASES_4, ids=[c.name for c in CASES_4])
def test_four_processes(world4, case):
    check_case(world4, case)


def test_1f1b_keeps_fewer_activations_than_gpipe():
    """With more microbatches than stages, 1f1b frees each microbatch before the next starts."""
    plans = {"1f1b": TeraPipePlan([16, 16, 16, 16]),
             "gpipe": TeraPipePlan([16, 16, 16, 16], order="gpipe")}
    peaks = spawn(2, "harness:measure_peak_activations",
                  TinyGPT(seq_length=64), plans, 8, 2, False, timeout=600)
    for stage, p in enumerate(peaks):
        assert p["1f1b"] > 0
        assert p["1f1b"] * 2 <= p["gpipe"], f"stage {stage}: {p}"
