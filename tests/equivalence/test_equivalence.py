"""TeraPipe against Megatron's no-pipelining run: every reported loss and every gradient.

Each world (2 or 4 gloo processes) runs its cases once (module fixture). A case builds the full
model with Megatron's own local spec and runs `forward_backward_no_pipelining` on all the
batches; then each rank builds its pipeline (and tensor) shard with the slice-aware spec, copies
in the same weights and runs `forward_backward_terapipe` on the same batches (data-parallel
ranks on their share). On every rank, `harness.check_case` then compares:

- every parameter's gradient (main_grad under Megatron DDP) with the reference gradient cut to
  the same shard, both as float32. Gradients are of the loss Megatron backpropagates: the
  masked token sum / token count / number of microbatches (with calculate_per_token_loss the
  plain sum; DDP averages over data-parallel ranks, which gives the same). Two checks:
  max|g - g_ref| / max|g_ref| <= max_normalised per parameter (normalised by that parameter's
  largest reference gradient; not for a gradient that is zero up to rounding, max|g_ref| <=
  zero_below, such as a key norm's bias in a layer without RoPE), and
  torch.testing.assert_close(g, g_ref, rtol, atol) on every element, i.e.
  |g - g_ref| <= atol + rtol * |g_ref|;
- on the last stage, every value reported by loss_func for every microbatch ([summed loss,
  token count], or the legacy averaged loss), element-wise with assert_close(loss_rtol,
  loss_atol).

Tolerances (harness.compare): float32 cases FP32 = max_normalised 1e-5 (zero_below 1e-8),
rtol 1e-4 / atol 1e-6 for gradients, rtol 1e-6 / atol 1e-6 for losses; measured worst: 8.7e-7 max-normalised,
1.1e-7 beyond rtol (the per-token-loss case, whose gradients are the largest), losses 1.3e-7
relative. bf16 cases BF16 = max_normalised 5e-2, rtol 1e-2 / atol 5e-3, losses rtol 5e-4 /
atol 1e-3; measured 1.6e-2, 1.5e-3 and 3.9e-5.

The cases without "w_" compute every gradient in the backward cells (defer_wgrad=False); the
"w_" cases run the default plan, whose W actions compute every parameter's gradient once per
sequence (linear weights and biases, norms, embedding tables).
"""

import dataclasses

import pytest
import torch

from megatron_terapipe import TeraPipePlan
from harness import (BF16, FP32, Case, TinyGPT, check_case, check_gradients, check_losses,
                     max_relative_error, spawn)



def Plan(*args, **kwargs) -> TeraPipePlan:
    """A plan whose gradients are all computed in the backward cells."""
    return TeraPipePlan(*args, defer_wgrad=False, **kwargs)


UNEVEN = Plan(seq_slices=[5, 7, 4])

CASES_2 = [
    Case("pp2_1f1b_uneven_more_mb", UNEVEN, num_microbatches=3),
    Case("pp2_gpipe_uneven_more_mb", Plan([5, 7, 4], order="gpipe"), num_microbatches=3),
    Case("pp2_1f1b_one_slice_fewer_mb", Plan([16]), num_microbatches=1),
    Case("pp2_gpipe_learned_abs", Plan([3, 13], order="gpipe"), num_microbatches=1,
         model=TinyGPT(position_embedding_type="learned_absolute")),
    Case("pp2_1f1b_learned_abs", UNEVEN, model=TinyGPT(position_embedding_type="learned_absolute")),
    Case("pp2_1f1b_batch_slices_own_tokens", Plan([[8, 8], [4, 4, 8]], batch_slices=[1, 2]),
         micro_batch_size=3, num_microbatches=2),
    Case("pp2_gpipe_batch_slices", Plan([8, 8], batch_slices=[2, 1], order="gpipe"),
         micro_batch_size=3, num_microbatches=4),
    Case("pp2_dataset_causal_mask", UNEVEN, with_mask=True),
    # Megatron-LM's packed sequences (--reset-attention-mask --reset-position-ids): documents
    # packed in each row, a block-diagonal causal mask and positions from each document's start
    Case("pp2_packed_documents", UNEVEN, packed=True, num_microbatches=4),
    Case("w_pp2_packed_documents_learned_abs_gpipe", TeraPipePlan([3, 9, 4], order="gpipe"),
         packed=True, model=TinyGPT(position_embedding_type="learned_absolute")),
    Case("pp2_legacy_two_tuple_loss", UNEVEN, legacy_loss=True),
    Case("pp2_per_token_loss", UNEVEN, model=TinyGPT(calculate_per_token_loss=True)),
    Case("pp2_grouped_query_attention", UNEVEN, model=TinyGPT(num_query_groups=2)),
    Case("pp2_tied_embeddings_ddp", UNEVEN, model=TinyGPT(untie=False), ddp=True),
    Case("pp2_selective_recompute", UNEVEN,
         model=TinyGPT(recompute_granularity="selective", recompute_modules=("core_attn",))),
    Case("pp2_full_recompute", Plan([5, 7, 4], order="gpipe"),
         model=TinyGPT(recompute_granularity="full")),
    Case("pp2_forward_only", UNEVEN, forward_only=True),
    # Megatron's own P2PCommunicator (the CUDA path) with its fused send/receive calls.
    Case("pp2_megatron_p2p_1f1b", UNEVEN, transport="megatron", num_microbatches=4),
    Case("pp2_megatron_p2p_gpipe", Plan([5, 7, 4], order="gpipe"), transport="megatron"),
    # bf16 through Megatron's Float16Module: both sides round differently once slices change
    # the summation order, so the bound is bf16's (8 mantissa bits), not fp32's.
    Case("pp2_bf16_float16module", UNEVEN, model=TinyGPT(bf16=True, params_dtype=torch.bfloat16),
         tolerance=BF16),
    # config.deallocate_pipeline_outputs: sent outputs freed, backward through the engine.
    Case("pp2_deallocate_outputs", UNEVEN, deallocate_outputs=True),
    Case("pp2_megatron_p2p_deallocate_outputs", dataclasses.replace(UNEVEN, defer_wgrad=True),
         transport="megatron", num_microbatches=4, deallocate_outputs=True),
]

CASES_4 = [
    Case("pp4_1f1b_more_mb", UNEVEN, pp=4, num_microbatches=5),
    Case("pp4_gpipe_fewer_mb", Plan([8, 4, 4], order="gpipe"), pp=4, num_microbatches=2),
    Case("pp4_1f1b_batch_slices", Plan([4, 12], batch_slices=[1, 1]), pp=4,
         num_microbatches=3),
    Case("pp4_megatron_p2p_1f1b", Plan([8, 8]), pp=4, num_microbatches=5,
         transport="megatron"),
    Case("tp2_pp2_1f1b", Plan([6, 6, 4]), tp=2, pp=2),
    Case("tp2_pp2_gpipe_rope_gqa", Plan([2, 14], order="gpipe"), tp=2, pp=2,
         model=TinyGPT(num_query_groups=2)),
    # Sequence parallelism: slices are multiples of TP, stage transfers carry tokens / TP.
    Case("tp2_pp2_sequence_parallel", Plan([6, 6, 4]), tp=2, pp=2, ddp=True,
         model=TinyGPT(sequence_parallel=True)),
    Case("tp2_pp2_sequence_parallel_gpipe_learned_abs", Plan([2, 10, 4], order="gpipe"),
         tp=2, pp=2, ddp=True,
         model=TinyGPT(sequence_parallel=True, position_embedding_type="learned_absolute")),
    Case("w_tp2_pp2_sequence_parallel_packed_documents", TeraPipePlan([6, 6, 4]), tp=2, pp=2,
         ddp=True, packed=True, model=TinyGPT(sequence_parallel=True)),
    Case("dp2_pp2_ddp_1f1b", UNEVEN, pp=2, ddp=True, num_microbatches=2),
    Case("dp2_pp2_ddp_gpipe", Plan([5, 7, 4], order="gpipe"), pp=2, ddp=True,
         num_microbatches=3),
    Case("pp4_gpipe_deallocate_outputs", Plan([8, 4, 4], order="gpipe"), pp=4,
         num_microbatches=2, deallocate_outputs=True),
]


# Deferred weight gradients (W actions): the same comparison, and the layers must really defer.
def deferred(plan: TeraPipePlan) -> TeraPipePlan:
    return dataclasses.replace(plan, defer_wgrad=True)


DEFERRED = deferred(TeraPipePlan([5, 7, 4]))
ATTENTION_OPTIONS = TinyGPT(spec_and_config=(("qk_layernorm", True),), config_extra=(
    ("attention_output_gate", True), ("no_rope_freq", 2), ("softmax_scale", 0.3),
    ("rotary_interleaved", True)))

CASES_2.append(Case("pp2_attention_per_token_options", UNEVEN,
                    model=ATTENTION_OPTIONS))  # the w_ case below without deferral

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
    # Each parameter kind's deferred path: learned positions (torch Embedding), RMSNorm, the
    # legacy mean loss, and a tied embedding on one stage (the lookup's and the output layer's
    # gradients of one parameter, one of them in DDP's main_grad, the other through its hook).
    Case("w_pp2_gpipe_learned_abs", TeraPipePlan([3, 13], order="gpipe"), num_microbatches=1,
         model=TinyGPT(position_embedding_type="learned_absolute")),
    Case("w_pp2_rmsnorm", DEFERRED, model=TinyGPT(normalization="RMSNorm")),
    Case("w_pp2_legacy_two_tuple_loss", DEFERRED, legacy_loss=True),
    # MoE (dropless top-2, alltoall): expert layers get a different token count per cell.
    Case("w_pp2_moe", DEFERRED, model=TinyGPT(num_experts=4)),
    # Attention options Megatron applies per token, around the core attention (the slice
    # attention computes only the softmax part): query-key norms, the output gate, layers
    # without RoPE, a given softmax scale, interleaved RoPE
    # (tests/glue/platform/test_attention_features.py classifies every field).
    Case("w_pp2_attention_per_token_options", DEFERRED, model=ATTENTION_OPTIONS),
    Case("w_pp2_qk_l2_norm", DEFERRED, model=TinyGPT(spec_and_config=(("qk_l2_norm", True),))),
    Case("w_dp2_tied_embeddings_one_stage_ddp_overlap", DEFERRED, pp=1, ddp=True,
         overlap_grad_reduce=True, model=TinyGPT(untie=False, num_layers=2)),
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
    # Scatter-gather messages: each TP rank sends half of each message, the receivers gather.
    Case("w_tp2_pp2_1f1b_scatter_gather", deferred(TeraPipePlan([6, 6, 4])), tp=2, pp=2,
         scatter_gather=True),
    Case("w_tp2_pp2_scatter_gather_megatron_p2p_ddp", deferred(TeraPipePlan([5, 7, 4])), tp=2,
         pp=2, ddp=True, transport="megatron", num_microbatches=4, scatter_gather=True),
    Case("w_tp2_pp2_sequence_parallel_ddp", deferred(TeraPipePlan([6, 6, 4])), tp=2, pp=2,
         ddp=True, model=TinyGPT(sequence_parallel=True)),
    Case("w_dp2_pp2_ddp_overlap", DEFERRED, pp=2, ddp=True, overlap_grad_reduce=True,
         num_microbatches=2),
    Case("w_tp2_pp2_sequence_parallel_gpipe_learned_abs",
         TeraPipePlan([2, 10, 4], order="gpipe"), tp=2, pp=2, ddp=True,
         model=TinyGPT(sequence_parallel=True, position_embedding_type="learned_absolute")),
    Case("w_dp2_pp2_ddp_overlap_early_w",
         TeraPipePlan([5, 7, 4], defer_wgrad=True, wgrad_points=[[2, 1], [1]]), pp=2, ddp=True,
         overlap_grad_reduce=True, num_microbatches=2),
]

CASES_2 += DEFERRED_2
CASES_4 += DEFERRED_4


#: What the world2 / world4 fixtures run (conftest.py): WORKER on each world's cases.
WORKER = "harness:run_cases"
WORLDS = {2: CASES_2, 4: CASES_4}


@pytest.mark.parametrize("case", CASES_2, ids=[c.name for c in CASES_2])
def test_two_processes(world2, case):
    check_case(world2, case)


@pytest.mark.parametrize("case", CASES_4, ids=[c.name for c in CASES_4])
def test_four_processes(world4, case):
    check_case(world4, case)


def test_scatter_gather_carries_half_over_the_pipeline_link(world4):
    """With scatter_gather each of the 2 TP ranks receives half of every message over the
    pipeline link (the other half comes from its TP peer's all-gather); the same plan without
    it receives whole messages. Through Megatron's communicator too: the same 16 tokens per
    microbatch, 4 microbatches against 3. The gradients are checked in the cases themselves."""
    for rank_result in world4:
        whole = rank_result["w_tp2_pp2_1f1b"]
        halves = rank_result["w_tp2_pp2_1f1b_scatter_gather"]
        megatron = rank_result["w_tp2_pp2_scatter_gather_megatron_p2p_ddp"]
        assert whole["receives"] == halves["receives"] > 0
        assert whole["received_elements"] == 2 * halves["received_elements"] > 0, rank_result
        assert 3 * megatron["received_elements"] == 4 * halves["received_elements"], rank_result


def test_activation_memory_against_megatron_1f1b():
    """Peak saved-activation bytes per stage, all three schedules under one SavedTensorMeter:
    2 stages, 8 microbatches of 2 x 64 tokens, 4 token slices of 16. Megatron's 1F1B holds 2
    microbatches on stage 0 in its steady state; TeraPipe's 1f1b order warms up in token slices,
    so fewer tokens are in flight and its worse stage holds no more than Megatron's worse stage
    (measured 729 KiB against 1202 KiB). gpipe holds all 8 microbatches until the first
    backward (measured 4.4 and 4.9 MiB)."""
    plans = {"1f1b": TeraPipePlan([16, 16, 16, 16]),
             "gpipe": TeraPipePlan([16, 16, 16, 16], order="gpipe")}
    peaks = spawn(2, "harness:measure_peak_activations",
                  TinyGPT(seq_length=64), plans, 8, 2, True, timeout=600)
    worst = {name: max(p[name] for p in peaks) for name in ("1f1b", "megatron_1f1b")}
    assert 0 < worst["1f1b"] <= worst["megatron_1f1b"], peaks
    for stage, p in enumerate(peaks):
        assert p["1f1b"] > 0 and p["megatron_1f1b"] > 0, f"stage {stage}: {p}"
        # measured 3.6x (stage 0) and 7.3x (stage 1)
        assert p["gpipe"] >= 2 * max(p["1f1b"], p["megatron_1f1b"]), f"stage {stage}: {p}"


def test_the_checks_catch_small_errors():
    """The element-wise check catches an error in a small gradient element that the
    max-normalised check lets through, and in a gradient that is zero up to rounding (which
    the max-normalised check leaves out); a missing gradient and a changed loss fail too."""
    ref = torch.tensor([1.0, 1e-3])
    slightly_off = {"w": (torch.tensor([1.0, 1e-3 + 5e-6]), ref)}  # 5e-6 max-normalised
    assert max_relative_error(slightly_off)[0] <= FP32.max_normalised
    with pytest.raises(AssertionError, match="gradient of w"):
        check_gradients(slightly_off, FP32, "here")
    with pytest.raises(AssertionError, match="gradient of w"):
        check_gradients({"w": (None, ref)}, FP32, "here")
    check_gradients({"w": (ref.clone(), ref)}, FP32, "here")
    # a gradient zero up to rounding: rounding on both sides passes, a real value does not
    zero = torch.tensor([7e-11, -2e-11])
    check_gradients({"w": (ref.clone(), ref), "b": (torch.tensor([1.9e-10, 3e-11]), zero)},
                    FP32, "here")
    with pytest.raises(AssertionError, match="gradient of b"):
        check_gradients({"w": (ref.clone(), ref), "b": (torch.tensor([3e-6, 0.0]), zero)},
                        FP32, "here")
    with pytest.raises(AssertionError, match="reported losses"):
        check_losses([[70.0, 24.0]], [[70.001, 24.0]], FP32, "here")
    check_losses([[70.0, 24.0]], [[70.0, 24.0]], FP32, "here")
