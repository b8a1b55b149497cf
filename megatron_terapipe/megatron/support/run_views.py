"""The support rules' adapters: a run as a RunView (support/refusals.py), from Megatron-LM's args
(`view_from_args`: the flags' names, megatron/training/arguments.py) or from a TransformerConfig
(`view_from_config`). Megatron-LM makes most of its model flags from the config's fields, so
the two read the same names where they can."""

from __future__ import annotations

from typing import Optional

from .refusals import CONFIGURE_GRAPHS, RunView
from .stage_layers import StageLayers, stage_layers


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _moe_fields(source, num_experts) -> dict:
    """The MoE fields; Megatron-LM's args and TransformerConfig share these names."""
    coeffs = _as_tuple(getattr(source, "moe_aux_loss_coeff", 0.0) or 0.0)
    return dict(num_experts=num_experts, moe_aux_loss_coeff=tuple(float(c) for c in coeffs),
                moe_router_load_balancing_type=_as_tuple(
                    getattr(source, "moe_router_load_balancing_type", "aux_loss")),
                moe_z_loss_coeff=getattr(source, "moe_z_loss_coeff", None),
                moe_expert_capacity_factor=getattr(source, "moe_expert_capacity_factor", None))


def dropout_values(source) -> tuple:
    """Megatron's dropout flags above 0 (args or a TransformerConfig: the names are the same)."""
    return tuple(f"--{name.replace('_', '-')} {p:g}"
                 for name in ("hidden_dropout", "attention_dropout")
                 if (p := float(getattr(source, name, 0.0) or 0.0)) > 0)


def backend_name(value) -> str:
    """--attention-backend by name (Megatron parses it to an AttnBackend); auto when unset."""
    return "auto" if value is None else str(getattr(value, "name", value))


def view_from_args(args) -> RunView:
    """Megatron-LM's args (names as in megatron/training/arguments.py) as the rules see them;
    an attribute a script does not define counts as unset."""
    def flag(name: str, default=None):
        value = getattr(args, name, None)
        return default if value is None else value

    graphs, decoder = bool(flag("terapipe_cuda_graphs", False)), flag("decoder_seq_length")
    moe, features = _moe_fields(args, flag("num_experts")), _feature_fields(args)
    return RunView(
        seq_length=flag("seq_length"), decoder_seq_length=None if decoder is None else int(decoder),
        tensor_parallel=int(flag("tensor_model_parallel_size", 1) or 1),
        context_parallel=int(flag("context_parallel_size", 1) or 1),
        hybrid_context_parallel=bool(flag("hybrid_context_parallel", False)),
        **moe,
        **{name: flag(name) for name in ("mtp_num_layers", "experimental_attention_variant",
                                         "window_size", "position_embedding_type")},
        **{name: bool(flag(name, False)) for name in (
            "use_legacy_models", "multi_latent_attention", "sft", "defer_embedding_wgrad_compute",
            "reset_attention_mask", "overlap_grad_reduce")},
        **features,
        attention_backend=backend_name(flag("attention_backend")),
        cuda_graphs=graphs, dropout=dropout_values(args),
        graph_safe_rng=bool(flag("te_rng_tracker", False)), megatron_graphs=megatron_graphs(args),
        graphs_device=_args_graphs_device(args) if graphs else "",
        scatter_gather=bool(flag("terapipe_scatter_gather_p2p", False)),
        sequence_parallel=bool(flag("sequence_parallel", False)),
        **_virtual_fields(args))


def _feature_fields(source) -> dict:
    """Attention, activation and schedule features TeraPipe refuses; Megatron-LM's args and a
    TransformerConfig share these names (the args' flags are made from the config's fields)."""
    return dict(softmax_type=getattr(source, "softmax_type", None) or "vanilla",
                activation_offloading=bool(getattr(source, "fine_grained_activation_offloading",
                                                   False)),
                cpu_offloading=bool(getattr(source, "cpu_offloading", False)),
                moe_paged_stash=bool(getattr(source, "moe_paged_stash", False)),
                moe_routing_replay=bool(getattr(source, "moe_enable_routing_replay", False)),
                ep_overlap=bool(getattr(source, "overlap_moe_expert_parallel_comm", False)),
                delay_wgrad_compute=bool(getattr(source, "delay_wgrad_compute", False)),
                partial_recompute=getattr(source,
                                          "num_microbatches_with_partial_activation_checkpoints",
                                          None),
                **{name: bool(getattr(source, name, False))
                   for name in ("qk_clip", "log_max_attention_logit")})


def megatron_graphs(source) -> str:
    """Megatron's own CUDA graphs: cuda_graph_impl, or the older flags Megatron-LM's
    validate_args (and a 0.16 config) turn into it; "none" when off."""
    impl = getattr(source, "cuda_graph_impl", None) or "none"
    if impl == "none" and getattr(source, "enable_cuda_graph", False):
        impl = "local"
    if impl == "none" and getattr(source, "external_cuda_graph", False):
        impl = "transformer_engine"
    return impl


def _virtual_fields(args) -> dict:
    """Chunks per pipeline stage as Megatron-LM's validate_args sets them from its flags
    (virtual_pipeline_model_parallel_size once validated), and the layers of a stage (of every
    stage where the split is even; support/stage_layers.py)."""
    pp = int(getattr(args, "pipeline_model_parallel_size", None) or 1)
    layers = getattr(args, "num_layers", None)
    per_stage = int(layers) // pp if layers is not None and int(layers) % pp == 0 else None
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vp is None:
        vp = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    per_chunk = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if vp is None and per_chunk is not None and per_stage is not None:
        vp = max(1, per_stage // int(per_chunk))  # Megatron-LM asserts that it divides
    try:
        split = split_of(args)
    except ValueError:
        if per_stage is None or per_stage % int(vp or 1) == 0:
            raise
        split = None  # chunks that do not divide an even stage: the support rules name them
    even = split is None or split.even
    return dict(virtual_stages=int(vp or 1), layers_per_stage=per_stage if even else None,
                stage_layers=split)


#: Megatron-LM's flags that split the layers over the pipeline stages and their model chunks.
SPLIT_FLAGS = ("num_layers", "pipeline_model_parallel_size", "num_virtual_stages_per_pipeline_rank",
               "num_layers_per_virtual_pipeline_stage",
               "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
               "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
               "pipeline_model_parallel_layout")


def split_of(args) -> Optional[StageLayers]:
    """stage_layers(args). Where the flags give no split Megatron can build, ValueError naming
    them: read as an even split, they would price a model Megatron does not build."""
    try:
        return stage_layers(args)
    except (ValueError, AssertionError, TypeError) as exc:
        given = " ".join(f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
                         for name in SPLIT_FLAGS
                         if (value := getattr(args, name, None)) not in (None, False))
        raise ValueError(
            f"{given}: Megatron cannot build this split of the layers over the pipeline stages "
            f"({exc or type(exc).__name__}); give --num-layers that the stages (and their model "
            "chunks) divide, or a --decoder-first-pipeline-num-layers / "
            "--decoder-last-pipeline-num-layers / --pipeline-model-parallel-layout that "
            "Megatron builds") from exc


def _args_graphs_device(args) -> str:
    import torch

    if getattr(args, "terapipe_cpu", False):
        return "--terapipe-cpu runs on CPU"
    return "" if torch.cuda.is_available() else "this process sees no CUDA device"


def view_from_config(config, cuda_graphs: bool = False, graphs_option: str = CONFIGURE_GRAPHS,
                     graphs_device: str = "") -> RunView:
    """A TransformerConfig as the rules see it (what `configure` checks), with TeraPipe's CUDA
    graphs (asked for by `graphs_option`; `graphs_device`: why no device captures them). The
    schedule adds what its call knows with dataclasses.replace."""
    dropout = dropout_values(config) if cuda_graphs else ()
    return RunView(
        context_parallel=int(getattr(config, "context_parallel_size", 1) or 1),
        hybrid_context_parallel=bool(getattr(config, "hybrid_context_parallel", False)),
        **_feature_fields(config),
        **{name: getattr(config, name, None) for name in ("window_size",
                                                          "experimental_attention_variant")},
        multi_latent_attention=bool(getattr(config, "multi_latent_attention", False)),
        virtual_stages=int(getattr(config, "virtual_pipeline_model_parallel_size", None) or 1),
        **_moe_fields(config, getattr(config, "num_moe_experts", None)),
        mtp_num_layers=getattr(config, "mtp_num_layers", None),
        attention_backend=backend_name(getattr(config, "attention_backend", None)),
        defer_embedding_wgrad_compute=bool(getattr(config, "defer_embedding_wgrad_compute", False)),
        cuda_graphs=cuda_graphs, graphs_option=graphs_option,
        megatron_graphs=megatron_graphs(config),
        overlap_option="Megatron DDP's overlap_grad_reduce", dropout=dropout,
        graph_safe_rng=bool(dropout) and graph_safe_rng_tracker(), graphs_device=graphs_device,
        scatter_gather=bool(getattr(getattr(config, "terapipe", None), "scatter_gather", False)),
        sequence_parallel=bool(getattr(config, "sequence_parallel", False)))


def graph_safe_rng_tracker() -> bool:
    """Whether Megatron's RNG tracker is set up and graph-safe (Transformer Engine's, or Megatron's
    with use_cudagraphable_rng)."""
    from ..platform import compat

    tp_random = compat.rng_module()
    tracker = tp_random._CUDA_RNG_STATE_TRACKER
    if not tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED or tracker is None:
        return False
    check = getattr(tp_random, "is_graph_safe_cuda_rng_tracker", None)
    return bool(check(tracker) if check else getattr(tracker, "use_cudagraphable_rng", False))
