"""Attention and activation features TeraPipe does not compute are refused before any work,
from Megatron-LM's flags and from a TransformerConfig, naming the flag and the fix; and every
config field Megatron's own core attention reads is either computed by TeraPipe's slice
attention or refused (a megatron-core line that reads a new one fails here until it is
classified)."""

from __future__ import annotations

import inspect
import re

import pytest

from megatron_terapipe import TeraPipePlan, configure
from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from megatron_terapipe.megatron.hooks import moe_losses
from test_arguments import parse

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
    (dict(moe_enable_routing_replay=True), "--moe-enable-routing-replay"),
    (dict(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0),
     "quantile_balancing"),
]
IDS = ["softmax_learnable", "softmax_off_by_one", "window", "qk_clip", "log_max_logit",
       "both_max_logit", "offloading", "routing_replay", "quantile_balancing"]
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


@pytest.mark.parametrize("fields, text", REFUSED, ids=IDS)
def test_configs_are_refused_by_configure(fields, text):
    try:
        config = _config(**fields)
    except (AssertionError, ValueError) as error:  # a line whose config refuses it itself
        pytest.skip(f"this megatron-core refuses the config itself: {error}")
    with pytest.raises(ValueError) as info:
        configure(config, TeraPipePlan([8, 8]))
    assert text in str(info.value), str(info.value)


def test_the_defaults_run():
    validate_terapipe_args(parse(["--pipeline-schedule", "terapipe"], softmax_type="vanilla",
                                 qk_clip=False, log_max_attention_logit=False, window_size=None,
                                 fine_grained_activation_offloading=False))
    configure(_config(), TeraPipePlan([8, 8]))
    if moe_losses.line_problem() is None:  # expert bias: token counts only
        validate_terapipe_args(parse(["--pipeline-schedule", "terapipe"], num_experts=4,
                                     moe_router_enable_expert_bias=True,
                                     moe_router_load_balancing_type="none"))


# What TeraPipe's slice attention (runtime/attention.py) does with each config field Megatron's
# DotProductAttention reads.
COMPUTED = {
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
REFUSED_FIELDS = {
    "softmax_type": "test_flags_are_refused_at_start_up",
    "window_size": "test_flags_are_refused_at_start_up",
    "window_attn_skip_freq": "only with window_size, which is refused",
    "context_parallel_size": "tests/test_arguments.py, tests/test_errors.py",
}


def test_every_field_megatrons_core_attention_reads_is_accounted_for():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    read = set(re.findall(r"config\.([A-Za-z_][A-Za-z0-9_]*)", inspect.getsource(DotProductAttention)))
    known = set(COMPUTED) | KERNEL_OR_PRECISION | set(REFUSED_FIELDS)
    assert read, "DotProductAttention reads no config field: the pattern no longer matches"
    assert read <= known, (f"megatron-core's DotProductAttention reads {sorted(read - known)}: "
                           "compute them in runtime/attention.py or refuse them (hooks/rules.py)")
