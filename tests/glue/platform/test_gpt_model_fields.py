"""Every model-config field Megatron's GPTModel reads (megatron/core/models/gpt/gpt_model.py:
the embedding, RoPE, the output layer and the loss around TeraPipe's cells) is honoured under
token slices, only sizes or initialises the model, belongs to inference, or is refused before
any work. A megatron-core line whose GPTModel reads a new field fails here until the field is
classified."""

from __future__ import annotations

from harness.inputs.config_reads import config_fields_read, config_refusal

HONOURED = {  # exact in the equivalence tests (tests/equivalence/test_equivalence.py unless said)
    "calculate_per_token_loss": "[pp2_per_token_loss]",
    "sequence_parallel": "[tp2_pp2_sequence_parallel*]",
    "virtual_pipeline_model_parallel_size": "tests/equivalence/test_virtual_runs.py",
    "pipeline_model_parallel_layout": "tests/equivalence/test_stage_split_runs.py, Megatron-LM's matrix",
    "position_embedding_type": "rope and learned_absolute; mrope refused (model/rope.py)",
    "rotary_base": "the RoPE table, at each slice's offset (model/rope.py)",
    "rotary_interleaved": "[w_pp2_attention_per_token_options]",
    "use_mup": "per-token multipliers; the attention scale reaches the slice attention as "
               "softmax_scale",
}
SIZES_AND_INIT = {"hidden_size", "init_method", "kv_channels", "use_cpu_initialization",
                  "embedding_init_method", "quant_recipe"}
INFERENCE = {"flash_decode", "materialize_only_last_token_logits", "inference_cuda_graph_scope"}
ONLY_WITH_REFUSED = {
    "cuda_graph_scope": "cuda_graph_impl", "mtp_loss_scaling_factor": "mtp_num_layers",
    "min_offloaded_tensor_size": "fine_grained_activation_offloading",
    "activation_offload_fraction": "fine_grained_activation_offloading",
    "delta_offload_bytes_across_pp_ranks": "fine_grained_activation_offloading",
    "fine_grained_offloading_max_inflight_offloads": "fine_grained_activation_offloading",
    "mrope_section": "mrope (refused from the flags and when the model is hooked)",
    # YaRN's table is built from multi-latent attention's config only
    **{f"yarn_{name}": "multi_latent_attention" for name in (
        "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "rotary_scaling_factor")},
}
REFUSED = {"cuda_graph_impl": "local", "defer_embedding_wgrad_compute": True,
           "fine_grained_activation_offloading": True, "moe_paged_stash": True,
           "mtp_num_layers": 1, "multi_latent_attention": True}


def test_every_field_megatrons_gpt_model_reads_is_accounted_for():
    from megatron.core.models.gpt import gpt_model

    read = config_fields_read(gpt_model)
    known = (set(HONOURED) | SIZES_AND_INIT | INFERENCE | set(ONLY_WITH_REFUSED) | set(REFUSED))
    assert "position_embedding_type" in read, "the pattern no longer finds config reads"
    assert read <= known, (f"megatron-core's GPTModel reads {sorted(read - known)}: say what "
                           "token slices do with them, or refuse them (support/refusals.py)")


def test_the_refused_model_fields_are_refused_from_a_config():
    for field, value in REFUSED.items():
        assert config_refusal(**{field: value}), field
    assert config_refusal() is None
