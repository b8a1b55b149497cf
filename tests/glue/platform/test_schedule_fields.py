"""Every model-config field Megatron's pipeline schedules read (megatron/core/pipeline_parallel/
schedules.py, which TeraPipe's schedule replaces) is honoured by TeraPipe, has no effect on what
it computes, or is refused before any work. A megatron-core line whose schedules read a new
field fails here until the field is classified."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.inputs.config_reads import config_fields_read, config_refusal

# honoured: the field's name appears where TeraPipe's code uses it (checked below)
HONOURED = ("autocast_dtype", "enable_autocast", "barrier_with_L1_time", "batch_p2p_comm",
            "calculate_per_token_loss", "deallocate_pipeline_outputs",
            "finalize_model_grads_func", "grad_scale_func", "grad_sync_func", "no_sync_func",
            "microbatch_group_size_per_vp_stage", "num_moe_experts", "sequence_parallel",
            "timers", "virtual_pipeline_model_parallel_size", "variable_seq_lengths",
            "hidden_size", "moe_grad_scale_func")
NO_EFFECT = {
    "param_sync_func": "Megatron DDP's forward pre-hook starts a bucket's parameter all-gather "
                       "itself when no schedule did (finish_param_sync): only the overlap differs",
    "overlap_p2p_comm": "TeraPipe's sends never block (runtime/comm/transport.py)",
    "overlap_p2p_comm_warmup_flush": "TeraPipe's sends never block (runtime/comm/transport.py)",
    "cuda_graph_scope": "only with cuda_graph_impl, which is refused",
    "mtp_grad_scale_func": "only with mtp_num_layers, which is refused",
    "experimental_attention_variant_loss_scale_func": "only with experimental_attention_variant, "
                                                      "which is refused",
}
# refused: a config with this value is refused by the support rules (support/refusals.py)
REFUSED = {
    "cuda_graph_impl": "local",
    "defer_embedding_wgrad_compute": True,
    "fine_grained_activation_offloading": True,
    "hybrid_context_parallel": True,
    "mtp_num_layers": 1,
    "overlap_moe_expert_parallel_comm": True,
    "num_microbatches_with_partial_activation_checkpoints": 2,
    "moe_paged_stash": True,
    "experimental_attention_variant": "gated_delta_net",
}


def test_every_field_megatrons_schedules_read_is_accounted_for():
    from megatron.core.pipeline_parallel import schedules

    read = config_fields_read(schedules)
    known = set(HONOURED) | set(NO_EFFECT) | set(REFUSED)
    assert "deallocate_pipeline_outputs" in read, "the pattern no longer finds config reads"
    assert read <= known, (f"megatron-core's pipeline schedules read {sorted(read - known)}: "
                           "honour them in TeraPipe's schedule or refuse them (support/refusals.py)")


def test_the_honoured_fields_are_read_by_terapipe():
    import megatron_terapipe

    package = Path(megatron_terapipe.__file__).parent
    rules = {"support/refusals.py", "support/run_views.py"}
    text = "\n".join(p.read_text() for p in package.rglob("*.py") if p.name not in rules)
    missing = [name for name in HONOURED if name not in text]
    assert not missing, f"no TeraPipe code reads {missing}: classify them again"


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_the_refused_fields_are_refused_from_a_config(field):
    extra = {"num_moe_experts": 4} if field == "overlap_moe_expert_parallel_comm" else {}
    message = config_refusal(**{field: REFUSED[field]}, **extra)
    assert message is not None, f"config.{field} = {REFUSED[field]!r} is not refused"
    assert config_refusal(**extra) is None
