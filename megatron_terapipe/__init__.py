"""megatron-terapipe: TeraPipe token-level pipeline parallelism for Megatron-Core.

    import megatron_terapipe as mt
    spec = mt.get_gpt_layer_spec()                      # build GPTModel with this layer spec
    mt.configure(config, mt.TeraPipePlan(seq_slices=[768, 512, 512, 256]))
    mt.install()                                        # get_forward_backward_func -> TeraPipe
"""

from .cpu import enable_cpu_mode
from .executor import forward_backward_terapipe
from .integration import configure, install
from .plan import PlanTable, TeraPipePlan
from .schedule import Action, Cell, Schedule, ScheduleError, build_schedule, timeline, validate
from .spec import get_gpt_layer_spec

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Cell",
    "Schedule",
    "ScheduleError",
    "PlanTable",
    "TeraPipePlan",
    "build_schedule",
    "configure",
    "enable_cpu_mode",
    "forward_backward_terapipe",
    "get_gpt_layer_spec",
    "install",
    "timeline",
    "validate",
]
