"""Which plan TeraPipe runs: a plan attached to a model config (`configure`), or one chosen
for every model (`select`, e.g. from the flags). Megatron's schedule getter (install.py) and the
schedule itself (forward_backward.py) both read this state; it imports neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..plan import TeraPipePlan


@dataclass
class SelectionState:
    selected: bool = False  # get_forward_backward_func returns TeraPipe's schedule
    default_source: object = None  # plan or provider used when a model config carries none
    schedule_wrapper: Optional[Callable[[Callable], Callable]] = None  # e.g. MegatronLMCells


STATE = SelectionState()
VIRTUAL_STAGES_UNSUPPORTED = (
    "TeraPipe does not support virtual pipeline stages: drop "
    "--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size")


def select(source) -> None:
    """Use `source` (a TeraPipePlan or a provider with plan_for) for every model, e.g. from flags."""
    if not isinstance(source, TeraPipePlan) and not hasattr(source, "plan_for"):
        raise ValueError(f"select() takes a TeraPipePlan or a plan provider, got {type(source).__name__}")
    STATE.default_source = source
    STATE.selected = True


def default_plan_source():
    return STATE.default_source


def configure(config, plan) -> None:
    """Validate `plan` against the model config and attach it (config.terapipe_plan).

    `plan` is a TeraPipePlan, or a provider with `plan_for(seq_length, micro_batch_size)` for
    runs whose sequence length changes. Also selects TeraPipe for `get_forward_backward_func`
    once `install()` has run.
    """
    if isinstance(plan, TeraPipePlan):
        check_config(config, plan)
    elif not hasattr(plan, "plan_for"):
        raise ValueError(
            f"configure() takes a TeraPipePlan or a plan provider with plan_for(), got {type(plan).__name__}")
    else:
        check_config(config, None)
    config.terapipe_plan = plan
    STATE.selected = True


def check_config(config, plan: Optional[TeraPipePlan], cp_size: Optional[int] = None) -> None:
    """Model-level features TeraPipe cannot run, named with the fix.

    cp_size: the context-parallel group's size when known (the schedule passes it), else the
    config's context_parallel_size.
    """
    cp = cp_size if cp_size is not None else getattr(config, "context_parallel_size", 1)
    if cp > 1:
        raise ValueError(
            f"TeraPipe does not support context parallelism (context_parallel_size={cp}): "
            "token slices already split the sequence; set --context-parallel-size 1")
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        raise ValueError(VIRTUAL_STAGES_UNSUPPORTED)
    if getattr(config, "num_moe_experts", None):
        raise ValueError("TeraPipe does not support MoE models yet: unset --num-experts "
                         "or use Megatron's 1f1b schedule")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("TeraPipe does not support --defer-embedding-wgrad-compute: drop it")
    if getattr(config, "mtp_num_layers", None):
        raise ValueError("TeraPipe does not support multi-token prediction: unset --mtp-num-layers")
    if plan is not None and getattr(config, "sequence_parallel", False):
        plan.check_multiple_of(config.tensor_model_parallel_size)


def deselect() -> None:
    """Make get_forward_backward_func return Megatron's own schedules again."""
    STATE.selected = False
    STATE.default_source = None
    STATE.schedule_wrapper = None


def selected() -> bool:
    return STATE.selected


def set_schedule_wrapper(wrapper: Optional[Callable[[Callable], Callable]]) -> None:
    """While TeraPipe is selected, get_forward_backward_func returns `wrapper(schedule)`.

    `setup_from_args` uses it to run Megatron-LM's forward_step per cell (MegatronLMCells).
    None restores the plain schedule.
    """
    STATE.schedule_wrapper = wrapper
