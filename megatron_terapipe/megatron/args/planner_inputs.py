"""PlannerInputs from Megatron-LM's flags: the model shape, the GPU preset and the links between
stages, the analytic or profiled cost model, the search space with its stage memory
(--terapipe-memory-profile), and the budget (--terapipe-memory-budget) with the model state
(--terapipe-model-state-memory, or Megatron's accounting from the precision, data parallelism
and --use-distributed-optimizer). terapipe-plan's options are the other adapter
(planner/cli_inputs.py); both build through planner/inputs.py."""

from __future__ import annotations

import os
from typing import Optional

from ...planner.cost.dims import Hardware
from ...planner.cost.presets import hardware_preset
from ...planner.cost.stage_memory import ModelStateConfig
from ...planner.inputs import PlannerInputs, layer_cost_model, memory_budget, stage_memory
from ...planner.profile.time_fit import LayerTimeFit
from ...planner.search import SearchSpace, stages_cross_nodes
from .checks import TeraPipeArgumentError
from .flags import (cp_size, data_parallel_size, defer_wgrad, dtype_bytes, granularity,
                    num_microbatches, pp_size, size_flag, slice_multiple, tp_size,
                    world_size)
from .model_shape import device_name, model_dims_from_args
from .plan_report import WARNING
from .profile_cache import profile_cache_path


#: The analytic model's GPU when the device matches no preset (said loudly at start-up).
ASSUMED_HARDWARE = "a100"


def hardware_from_args(args) -> tuple[Hardware, str]:
    """The analytic model's GPU preset, and a warning (the report's WARNING note) when the
    device name matches none and the preset is assumed."""
    name = getattr(args, "terapipe_hardware", "auto") or "auto"
    if name != "auto":
        return hardware_preset(name), ""
    device = device_name().lower()
    for preset in ("h100", "a100", "v100"):
        if preset in device:
            return hardware_preset(preset), ""
    return hardware_preset(ASSUMED_HARDWARE), (
        f"{WARNING}the analytic cost model assumes {ASSUMED_HARDWARE.upper()} GPUs: device "
        f"'{device_name()}' matches no preset; give --terapipe-hardware {{v100,a100,h100}} for "
        "the GPUs the run trains on, or --terapipe-cost-model profile to measure this device")


def stages_cross_nodes_from_args(args) -> bool:
    """`search.stages_cross_nodes` for this launch: Megatron's rank order puts the TP, CP and DP
    ranks of a stage between neighbouring stages; a node is LOCAL_WORLD_SIZE ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size(args)))
    ranks_per_stage = tp_size(args) * cp_size(args) * data_parallel_size(args)
    return stages_cross_nodes(ranks_per_stage, pp_size(args), local)


def _cost_model(args, fit: Optional[LayerTimeFit] = None, path: Optional[str] = None):
    hardware, note = hardware_from_args(args)
    try:
        model = layer_cost_model(model_dims_from_args(args), hardware, pp_size(args),
                                 tensor_parallel=tp_size(args), dtype_bytes=dtype_bytes(args),
                                 cross_nodes=stages_cross_nodes_from_args(args),
                                 profile_path=path, fit=fit)
    except ValueError as exc:
        raise TeraPipeArgumentError(f"--terapipe-cost-model {path}: {exc}") from None
    return model, ([note] if note and fit is None and path is None else [])


def cost_model_from_args(args, seq_length: int, micro_batch_size: int,
                         fit: Optional[LayerTimeFit] = None):
    """The cost model the flags name, with notes for the log. The profile cost model uses
    `fit`, else the cached profile of this shape, else (explicit slices, nothing measured yet)
    the analytic model for the prediction."""
    choice = getattr(args, "terapipe_cost_model", "analytic") or "analytic"
    if choice == "analytic":
        return _cost_model(args)
    if choice != "profile":
        return _cost_model(args, path=choice)
    if fit is None:
        path = profile_cache_path(args, seq_length, micro_batch_size)
        if not path.is_file():
            model, notes = _cost_model(args)
            return model, notes + [
                "no measured profile for this shape yet; prediction from the analytic model"]
        fit = LayerTimeFit.load(path)
    return _cost_model(args, fit=fit)


def _size(args, name: str) -> Optional[float]:
    try:
        return size_flag(args, name)
    except ValueError as exc:
        raise TeraPipeArgumentError(f"--{name.replace('_', '-')}: {exc}") from None


def budget_from_args(args):
    """The budget the flags give (None: no limit), with the model state per stage."""
    config = ModelStateConfig(dtype_bytes=dtype_bytes(args), data_parallel=data_parallel_size(args),
                              distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
                              tensor_parallel=tp_size(args),
                              untie_embeddings=bool(getattr(args, "untie_embeddings_and_output_weights",
                                                            False)))
    return memory_budget(model_dims_from_args(args), pp_size(args),
                         _size(args, "terapipe_memory_budget"),
                         _size(args, "terapipe_model_state_memory"), config)


def search_space_from_args(args, seq_length: int, micro_batch_size: int) -> SearchSpace:
    path = getattr(args, "terapipe_memory_profile", None)
    try:
        memory = stage_memory(model_dims_from_args(args), pp_size(args), path)
    except ValueError as exc:
        raise TeraPipeArgumentError(f"--terapipe-memory-profile: {exc}") from None
    return SearchSpace(seq_length, micro_batch_size, pp_size(args),
                       num_microbatches(args, micro_batch_size),
                       order=getattr(args, "terapipe_order", "1f1b"),
                       granularity=granularity(args), multiple_of=slice_multiple(args),
                       defer_wgrad=defer_wgrad(args), memory=memory)


def planner_inputs(args, seq_length: int, micro_batch_size: int,
                   fit: Optional[LayerTimeFit] = None) -> PlannerInputs:
    """What the planner starts from for a (seq_length, micro_batch_size) of this run."""
    cost, notes = cost_model_from_args(args, seq_length, micro_batch_size, fit)
    return PlannerInputs(model_dims_from_args(args), cost,
                         search_space_from_args(args, seq_length, micro_batch_size),
                         budget_from_args(args), notes)
