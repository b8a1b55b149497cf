"""The planner's inputs from Megatron-LM's flags: the model shape, the GPU preset, the link
between stages, and the analytic or profiled cost model built from them."""

from __future__ import annotations

import os
import platform

from ...planner.cost.analytic import AnalyticCostModel
from ...planner.cost.dims import Hardware, Link, ModelDims
from ...planner.profile.time_fit import LayerTimeFit
from ...planner.cost.presets import hardware_preset
from ...planner.profile.profiled_cost import ProfiledCostModel
from ...planner.search import pipeline_link, stages_cross_nodes
from .flags import (cp_size, data_parallel_size, dtype_bytes, int_or_none, layers_per_stage,
                    pp_size, tp_size, world_size)
from .checks import TeraPipeArgumentError


def model_dims_from_args(args) -> ModelDims:
    """The planner's ModelDims from Megatron-LM's model flags."""
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    try:
        return ModelDims(num_layers=int(args.num_layers), hidden_size=int(args.hidden_size),
                         num_attention_heads=int(args.num_attention_heads),
                         ffn_hidden_size=int_or_none(getattr(args, "ffn_hidden_size", None)),
                         num_query_groups=int_or_none(groups),
                         gated_linear_unit=bool(getattr(args, "swiglu", False)),
                         # Megatron-LM pads the tokenizer's vocabulary (padded_vocab_size);
                         # scripts without a tokenizer give --vocab-size. It prices the embedding
                         # and the output layer (edge costs); unknown means none.
                         vocab_size=int_or_none(getattr(args, "padded_vocab_size", None)
                                                or getattr(args, "vocab_size", None)),
                         name="this model")
    except AttributeError as exc:
        raise TeraPipeArgumentError(
            f"planning needs the model shape (--num-layers, --hidden-size, --num-attention-heads): "
            f"{exc}; or give --terapipe-slices / --terapipe-num-slices") from None


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        try:
            return torch.cuda.get_device_name()
        except Exception:  # pragma: no cover
            return "cuda"
    return f"cpu ({platform.machine()}, {platform.processor() or 'unknown'})"


def hardware_from_args(args) -> tuple[Hardware, str]:
    """The analytic model's GPU preset, and a note when it had to be guessed."""
    name = getattr(args, "terapipe_hardware", "auto") or "auto"
    if name != "auto":
        return hardware_preset(name), ""
    device = device_name().lower()
    for preset in ("h100", "a100", "v100"):
        if preset in device:
            return hardware_preset(preset), ""
    return hardware_preset("a100"), f"device '{device_name()}' has no preset; assuming a100"


def stages_cross_nodes_from_args(args) -> bool:
    """`search.stages_cross_nodes` for this launch: Megatron's rank order puts the TP, CP and DP
    ranks of a stage between neighbouring stages; a node is LOCAL_WORLD_SIZE ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size(args)))
    ranks_per_stage = tp_size(args) * cp_size(args) * data_parallel_size(args)
    return stages_cross_nodes(ranks_per_stage, pp_size(args), local)


def link_from_args(args) -> Link:
    hardware, _ = hardware_from_args(args)
    return pipeline_link(hardware, stages_cross_nodes_from_args(args))


def analytic_cost_model(args) -> tuple[AnalyticCostModel, str]:
    """The analytic model of the flags' model on their GPU preset, and the preset's note."""
    hardware, note = hardware_from_args(args)
    model = AnalyticCostModel(model_dims_from_args(args), hardware, layers_per_stage(args),
                              tensor_parallel=tp_size(args), dtype_bytes=dtype_bytes(args),
                              inter_node=stages_cross_nodes_from_args(args))
    return model, note


def profiled_cost_model(args, fit: LayerTimeFit) -> ProfiledCostModel:
    return ProfiledCostModel(fit, layers_per_stage(args), link_from_args(args),
                             model=model_dims_from_args(args), tensor_parallel=tp_size(args),
                             dtype_bytes=dtype_bytes(args))


def profiled_cost_model_from_file(args, path: str) -> ProfiledCostModel:
    try:
        return ProfiledCostModel.load(path, layers_per_stage(args), link_from_args(args),
                                      model=model_dims_from_args(args),
                                      tensor_parallel=tp_size(args), dtype_bytes=dtype_bytes(args))
    except ValueError as exc:
        raise TeraPipeArgumentError(f"--terapipe-cost-model {path}: {exc}") from None
