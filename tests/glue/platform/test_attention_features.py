"""Attention and activation features TeraPipe does not compute are refused before any work,
from Megatron-LM's flags and from a TransformerConfig, naming the flag and the fix; and every
config field Megatron's own core attention reads is either computed by TeraPipe's slice
attention or refused, and every one the self-attention around it reads either acts per token
(Megatron's code, one slice at a time) or is refused (a megatron-core line that reads a new one
fails here until it is classified)."""

from __future__ import annotations

import pytest

from harness.inputs.config_reads import config_fields_read, config_refusal
from megatron_terapipe import TeraPipePlan, configure
from megatron_terapipe.megatron.platform import router_versions
from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from harness.inputs.flags import parse

# (Megatron-LM flags as the namespace holds them, the same as TransformerConfig fields, the
# text the refusal must contain). Megatron-LM makes these flags from the config's fields.
REFUSED = [
    (dict(softmax_type="learnable"), "--softmax-type learnable"),
    (dict(softmax_type="off-by-one"), "--softmax-type off-by-one"),
    (dict(window_size=(16, 0)), "--window-size"),
    (dict(qk_clip=True), "--qk-clip"),
    (dict(log_max_attention_logit=True), "--log-max-attention-logit"),
    (dict(qk_clip=True, log_max_attention_logit=True), "--qk-clip and --log-max-attention-logit"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["core_attn"]),
     "--fine-grained-activation-offloading"),
    (dict(moe_paged_stash=True), "--moe-paged-stash"),
    (dict(moe_enable_routing_replay=True), "--moe-enable-routing-replay"),
    (dict(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0),
     "quantile_balancing"),
]
IDS = ["softmax_learnable", "softmax_off_by_one", "window", "qk_clip", "log_max_logit",
       "both_max_logit", "offloading", "paged_stash", "routing_replay", "quantile_balancing"]
MOE = ("moe_enable_routing_replay", "moe_router_load_balancing_type")


def _flags(fields: dict) -> dict:
    moe = any(name in fields for name in MOE)
    return {**fields, **({"num_experts": 4} if moe else {})}


@pytest.mark.parametrize("fields, text", REFUSED, ids=IDS)
def test_flags_are_refused_at_start_up(fields, text):
    for schedule in ("terapipe", "auto"):
        with pytest.raises(TeraPipeArgumentError) as info:
            validate_terapipe_args(parse(["--pipeline-schedule", schedule], **_flags(fields)))
        message = str(info.value)
        assert text in message and ("drop" in message or "use" in message), message
    validate_terapipe_args(parse(["--pipeline-schedule", "1f1b"], **_flags(fields)))


def _config(**fields):
    from megatron.core.transformer import TransformerConfig

    moe = any(name in fields for name in MOE)
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                             **({"num_moe_experts": 4} if moe else {}), **fields)


# TransformerConfig fields newer than the oldest tested megatron-core line, with the line that
# added each: only these may be missing (any other missing name is a typo, and fails)
NEWER_FIELDS = {"moe_paged_stash": (0, 19)}


def _fields_this_line_lacks(fields: dict) -> list[str]:
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    from megatron_terapipe.megatron.platform.compat import megatron_core_version

    known = {field.name for field in dataclasses.fields(TransformerConfig)}
    missing = sorted(set(fields) - known)
    line = megatron_core_version()[:2]
    unexplained = [name for name in missing if line >= NEWER_FIELDS.get(name, (0, 0))]
    assert not unexplained, (f"megatron-core {line[0]}.{line[1]}'s TransformerConfig has no "
                             f"field {unexplained}: misspelt, or newer (NEWER_FIELDS)?")
    return missing


@pytest.mark.parametrize("fields, text", REFUSED, ids=IDS)
def test_configs_are_refused_by_configure(fields, text):
    missing = _fields_this_line_lacks(fields)
    if missing:
        pytest.skip(f"this megatron-core's TransformerConfig predates {missing}")
    try:
        config = _config(**fields)
    except (AssertionError, ValueError) as error:  # megatron-core's own checks refuse it
        pytest.skip(f"this megatron-core refuses the config itself: {error}")
    with pytest.raises(ValueError) as info:
        configure(config, TeraPipePlan([8, 8]))
    assert text in str(info.value), str(info.value)


def test_transformer_engines_cpu_offloading_is_refused_from_a_config():
    """config.cpu_offloading (no Megatron-LM flag; Megatron allows it with one pipeline stage
    only, where TeraPipe still runs several token slices' forwards before their backwards)."""
    import argparse

    with pytest.raises(ValueError, match="config.cpu_offloading"):
        configure(argparse.Namespace(cpu_offloading=True), TeraPipePlan([8, 8]))


def test_the_defaults_run():
    validate_terapipe_args(parse(["--pipeline-schedule", "terapipe"], softmax_type="vanilla",
                                 qk_clip=False, log_max_attention_logit=False, window_size=None,
                                 fine_grained_activation_offloading=False))
    configure(_config(), TeraPipePlan([8, 8]))
    if router_versions.line_problem() is None:  # expert bias: token counts only
        validate_terapipe_args(parse(["--pipeline-schedule", "terapipe"], num_experts=4,
                                     moe_router_enable_expert_bias=True,
                                     moe_router_load_balancing_type="none"))


# What TeraPipe does with each config field Megatron's core attention (DotProductAttention,
# which the slice attention replaces) reads.
CORE_COMPUTED = {
    "kv_channels": "the head size, and the softmax scale 1 / sqrt(kv_channels)",
    "num_attention_heads": "the query heads (the tensors' shapes)",
    "num_query_groups": "grouped-query attention: K/V heads repeated over their queries",
    "attention_dropout": "dropout_p of scaled_dot_product_attention",
    "apply_query_key_layer_scaling": "divides and re-multiplies the scores by the layer number: "
                                     "the softmax input is unchanged",
}
KERNEL_OR_PRECISION = {  # which kernel runs, or what sizes and initialises softmax_offset
    "attention_softmax_in_fp32", "masked_softmax_fusion", "bf16", "fp16", "params_dtype",
    "init_method", "perform_initialization", "sequence_parallel",
}
# ... and each field Megatron's self-attention around it (attention/slice_attention.py) reads: Megatron's own
# code runs there under TeraPipe too, one token slice at a time.
PER_TOKEN = {  # projections, norms and gates of each token on its own, RoPE at its position
    "add_bias_linear", "add_qkv_bias", "hidden_size", "init_method", "output_layer_init_method",
    "kv_channels", "num_attention_heads", "num_query_groups", "layernorm_epsilon", "params_dtype",
    "fused_single_qkv_rope",  # Transformer Engine's kernel, given the slice's RoPE table
    # exact in tests/equivalence/test_equivalence.py (w_pp2_attention_per_token_options,
    # w_pp2_qk_l2_norm)
    "qk_layernorm", "qk_l2_norm", "attention_output_gate", "no_rope_freq", "softmax_scale",
    "rotary_interleaved",
}
ELSEWHERE = {
    "recompute_granularity": "selective core_attn recomputation: tests/equivalence/test_equivalence.py",
    "recompute_modules": "selective core_attn recomputation: tests/equivalence/test_equivalence.py",
    "virtual_pipeline_model_parallel_size": "the model chunks: tests/equivalence/test_virtual_runs.py",
    "batch_invariant_mode": "kernels", "fp4": "Transformer Engine precision",
    "fp8": "Transformer Engine precision", "fp8_recipe": "Transformer Engine precision",
    "test_mode": "a kernel path", "flash_attention_version": "Transformer Engine's kernel",
    "flash_decode": "inference decoding", "kv_lora_rank": "multi-latent attention (refused)",
    "cache_mla_latents": "multi-latent attention (refused)",
}
# refused (support/refusals.py), with a value that is: the tests above check each from a config
REFUSED_FIELDS = {
    "softmax_type": "learnable", "window_size": (16, 0), "context_parallel_size": 2,
    "qk_clip": True, "fine_grained_activation_offloading": True, "cuda_graph_impl": "local",
}
ONLY_WITH_REFUSED = {"window_attn_skip_freq": "window_size", "qk_clip_alpha": "qk_clip",
                     "qk_clip_threshold": "qk_clip", "offload_modules":
                     "fine_grained_activation_offloading", "cuda_graph_scope": "cuda_graph_impl"}


def test_every_field_megatrons_attention_reads_is_accounted_for():
    from megatron.core.transformer import attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    core, around = config_fields_read(DotProductAttention), config_fields_read(attention)
    refused = set(REFUSED_FIELDS) | set(ONLY_WITH_REFUSED)
    assert core and around, "the pattern no longer finds config reads"
    unknown = core - set(CORE_COMPUTED) - KERNEL_OR_PRECISION - refused
    assert not unknown, (f"megatron-core's DotProductAttention reads {sorted(unknown)}: compute "
                         "them in runtime/attention/slice_attention.py or refuse them (support/refusals.py)")
    unknown = around - PER_TOKEN - set(ELSEWHERE) - refused
    assert not unknown, (f"megatron-core's self-attention reads {sorted(unknown)}: say what a "
                         "token slice does with them, or refuse them (support/refusals.py)")
    assert set(ONLY_WITH_REFUSED.values()) <= set(REFUSED_FIELDS)


@pytest.mark.parametrize("field", sorted(REFUSED_FIELDS))
def test_the_refused_attention_fields_are_refused_from_a_config(field):
    assert config_refusal(**{field: REFUSED_FIELDS[field]})
