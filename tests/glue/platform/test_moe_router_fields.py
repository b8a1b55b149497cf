"""Every model-config field Megatron's MoE router reads (megatron/core/transformer/moe/router.py)
routes each token on its own (so a token slice routes as the whole microbatch would), is made
exact by TeraPipe (the router losses, model/moe_router_losses.py), only sizes or initialises the
router, or is refused before any work. A megatron-core line whose router reads a new field fails
here until the field is classified."""

from __future__ import annotations

import pytest

from harness.inputs.config_reads import config_fields_read, config_refusal

TOKEN_WISE = {  # a token's experts and weights depend on that token's logits only
    "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_dtype", "moe_router_fusion",
    "moe_router_enable_expert_bias",  # the bias update only adds up tokens per expert
}
EXACT_BY_TERAPIPE = {  # a whole microbatch's routing, rebuilt from its cells (model/moe_router_losses.py)
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type",
    "calculate_per_token_loss",
}
SIZES_AND_INIT = {"add_bias_linear", "hidden_size", "init_method", "params_dtype",
                  "perform_initialization", "num_moe_experts", "num_layers", "sequence_parallel"}
RANDOM = {  # random logits or noise, drawn per token (like dropout: not Megatron's very draws)
    "moe_input_jitter_eps",
    "moe_router_force_load_balancing",  # benchmark knob: random logits
    "moe_router_force_biased",  # benchmark knob: random logits, plus a random expert bias drawn
                                # per forward pass (per token slice under TeraPipe) when > 0
}
ONLY_WITH_REFUSED = {"moe_pad_expert_input_to_capacity": "moe_expert_capacity_factor",
                     "moe_token_drop_policy": "moe_expert_capacity_factor",
                     "mtp_use_repeated_layer": "mtp_num_layers"}
REFUSED = {"moe_expert_capacity_factor": 1.0, "moe_enable_routing_replay": True,
           "mtp_num_layers": 1}
REFUSED_TYPES = ("sinkhorn", "quantile_balancing")  # of moe_router_load_balancing_type


def test_every_field_megatrons_router_reads_is_accounted_for():
    from megatron.core.transformer.moe import router

    read = config_fields_read(router)
    known = (TOKEN_WISE | EXACT_BY_TERAPIPE | SIZES_AND_INIT | RANDOM | set(ONLY_WITH_REFUSED)
             | set(REFUSED))
    assert "moe_router_topk" in read, "the pattern no longer finds config reads"
    assert read <= known, (f"megatron-core's MoE router reads {sorted(read - known)}: say how a "
                           "token slice routes with them, or refuse them (support/refusals.py)")
    assert set(ONLY_WITH_REFUSED.values()) <= set(REFUSED)


@pytest.mark.parametrize("config", [
    *({field: value} for field, value in REFUSED.items()),
    *({"moe_router_load_balancing_type": kind} for kind in REFUSED_TYPES),
], ids=[*REFUSED, *REFUSED_TYPES])
def test_the_refused_router_fields_are_refused_from_a_config(config):
    assert config_refusal(num_moe_experts=4, **config) is not None, f"{config} is not refused"
    assert config_refusal(num_moe_experts=4) is None
