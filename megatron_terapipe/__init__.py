"""megatron-terapipe: TeraPipe token-level pipeline parallelism for Megatron-Core.

    import megatron_terapipe as mt
    spec = mt.get_gpt_layer_spec()                      # build GPTModel with this layer spec
    mt.configure(config, mt.TeraPipePlan(seq_slices=[768, 512, 512, 256]))
    mt.install()                                        # get_forward_backward_func -> TeraPipe
"""

from .plan import TeraPipePlan
from .plan import PlanTable
from .schedule import Action
from .schedule import Cell
from .schedule import Schedule
from .schedule import ScheduleError
from .schedule import build_schedule
from .schedule import timeline
from .schedule import validate
from .planner import (
    AnalyticCostModel,
    CostModel,
    ModelDims,
    ProfiledCostModel,
    SimulationResult,
    hardware_preset,
    model_preset,
    simulate,
    solve,
    solve_slicing,
    write_chrome_trace,
    write_png,
)
from .version import __version__

# What needs torch and Megatron-Core is imported on first use, so that the planner
# (terapipe-plan: numpy only) starts without them.
_LAZY = {
    "add_terapipe_args": "megatron.args.flags", "combine_extra_args": "megatron.args.flags",
    "ArgsPlanProvider": "megatron.args.plan_provider",
    "TeraPipeArgumentError": "megatron.args.checks",
    "validate_terapipe_args": "megatron.args.checks",
    "setup_from_args": "megatron.wiring",
    "disable_cpu_mode": "megatron.platform.cpu_mode", "enable_cpu_mode": "megatron.platform.cpu_mode",
    "keep_freed_host_memory": "megatron.platform.cpu_mode", "pin_to_core": "megatron.platform.cpu_mode",
    "forward_backward_terapipe": "megatron.hooks.forward_backward",
    "install": "megatron.hooks.install",
    "configure": "megatron.hooks.selection", "deselect": "megatron.hooks.selection",
    "select": "megatron.hooks.selection", "TeraPipeConfig": "megatron.hooks.selection",
    "install_hooks": "megatron.launch",
    "measure_layer_times": "megatron.measure.layers",
    "TorchNorm": "megatron.platform.torch_norm", "get_gpt_decoder_block_spec": "megatron.model.layer_specs",
    "get_gpt_layer_spec": "megatron.model.layer_specs",
    "place_in_v": "megatron.model.v_chunks", "v_chunk_roles": "megatron.model.v_chunks",
    "MeasuredChoice": "megatron.hooks.measured_choice",
    "TrialCandidate": "megatron.hooks.measured_choice",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_terapipe' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Action",
    "ArgsPlanProvider",
    "MeasuredChoice",
    "TrialCandidate",
    "TeraPipeArgumentError",
    "add_terapipe_args",
    "combine_extra_args",
    "deselect",
    "install_hooks",
    "select",
    "setup_from_args",
    "validate_terapipe_args",
    "AnalyticCostModel",
    "CostModel",
    "ModelDims",
    "ProfiledCostModel",
    "SimulationResult",
    "TorchNorm",
    "get_gpt_decoder_block_spec",
    "hardware_preset",
    "measure_layer_times",
    "model_preset",
    "simulate",
    "solve",
    "solve_slicing",
    "write_chrome_trace",
    "write_png",
    "Cell",
    "Schedule",
    "ScheduleError",
    "PlanTable",
    "TeraPipePlan",
    "TeraPipeConfig",
    "build_schedule",
    "configure",
    "disable_cpu_mode",
    "enable_cpu_mode",
    "keep_freed_host_memory",
    "pin_to_core",
    "forward_backward_terapipe",
    "get_gpt_layer_spec",
    "install",
    "place_in_v",
    "timeline",
    "v_chunk_roles",
    "validate",
]
