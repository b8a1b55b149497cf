"""megatron-terapipe: TeraPipe token-level pipeline parallelism for Megatron-Core.

    import megatron_terapipe as mt
    spec = mt.get_gpt_layer_spec()                      # build GPTModel with this layer spec
    mt.configure(config, mt.TeraPipePlan(seq_slices=[768, 512, 512, 256]))
    mt.install()                                        # get_forward_backward_func -> TeraPipe
"""

from .megatron.args.flags import add_terapipe_args, combine_extra_args
from .megatron.args.plan_provider import ArgsPlanProvider
from .megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from .megatron.wiring import setup_from_args
from .megatron.hooks.cpu import disable_cpu_mode, enable_cpu_mode, keep_freed_host_memory, pin_to_core
from .megatron.hooks.forward_backward import forward_backward_terapipe
from .megatron.hooks.install import install
from .megatron.hooks.selection import configure, deselect, select
from .megatron.launch import install_hooks
from .plan import PlanTable, TeraPipePlan
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
from .megatron.measure.layers import measure_layer_times
from .megatron.hooks.spec import TorchNorm, get_gpt_decoder_block_spec, get_gpt_layer_spec

from .version import __version__

__all__ = [
    "Action",
    "ArgsPlanProvider",
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
    "build_schedule",
    "configure",
    "disable_cpu_mode",
    "enable_cpu_mode",
    "keep_freed_host_memory",
    "pin_to_core",
    "forward_backward_terapipe",
    "get_gpt_layer_spec",
    "install",
    "timeline",
    "validate",
]
