"""Glue to Megatron: attach a plan to a config, and route get_forward_backward_func to TeraPipe."""

from __future__ import annotations

import sys
from typing import Callable, Optional

from .plan import TeraPipePlan

_ORIGINAL_GET_FORWARD_BACKWARD: Optional[Callable] = None
_SELECTED = False
_DEFAULT_SOURCE = None  # plan or provider used when a model config carries none


def select(source) -> None:
    """Use `source` (a TeraPipePlan or a provider with plan_for) for every model, e.g. from flags."""
    global _DEFAULT_SOURCE, _SELECTED
    if not isinstance(source, TeraPipePlan) and not hasattr(source, "plan_for"):
        raise ValueError(f"select() takes a TeraPipePlan or a plan provider, got {type(source).__name__}")
    _DEFAULT_SOURCE = source
    _SELECTED = True


def default_plan_source():
    return _DEFAULT_SOURCE


def configure(config, plan) -> None:
    """Validate `plan` against the model config and attach it (config.terapipe_plan).

    `plan` is a TeraPipePlan, or a provider with `plan_for(seq_length, micro_batch_size)` for
    runs whose sequence length changes. Also selects TeraPipe for `get_forward_backward_func`
    once `install()` has run.
    """
    global _SELECTED
    if isinstance(plan, TeraPipePlan):
        check_config(config, plan)
    elif not hasattr(plan, "plan_for"):
        raise ValueError(
            f"configure() takes a TeraPipePlan or a plan provider with plan_for(), got {type(plan).__name__}")
    else:
        check_config(config, None)
    config.terapipe_plan = plan
    _SELECTED = True


def check_config(config, plan: Optional[TeraPipePlan]) -> None:
    """Model-level features TeraPipe cannot run, named with the fix."""
    if getattr(config, "context_parallel_size", 1) > 1:
        raise ValueError(
            f"TeraPipe does not support context parallelism (context_parallel_size="
            f"{config.context_parallel_size}): set --context-parallel-size 1")
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        raise ValueError(
            "TeraPipe does not support virtual pipeline stages: drop "
            "--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size")
    if getattr(config, "num_moe_experts", None):
        raise ValueError("TeraPipe does not support MoE models yet: unset --num-experts")
    if plan is not None and getattr(config, "sequence_parallel", False):
        tp = config.tensor_model_parallel_size
        for ts in plan.token_slices:
            if any(t % tp for t in ts):
                raise ValueError(
                    f"TeraPipe token slices {list(ts)} must be multiples of the tensor-parallel "
                    f"size {tp} with sequence parallelism: choose slice lengths divisible by {tp}")


def deselect() -> None:
    """Make get_forward_backward_func return Megatron's own schedules again."""
    global _SELECTED, _DEFAULT_SOURCE
    _SELECTED = False
    _DEFAULT_SOURCE = None


def selected() -> bool:
    return _SELECTED


def _terapipe_or_megatron(*args, **kwargs):
    from .executor import forward_backward_terapipe

    if _SELECTED:
        pp_size = kwargs.get("pp_size", args[0] if args else None)
        vp_size = kwargs.get("vp_size", args[1] if len(args) > 1 else None)
        if vp_size is not None and vp_size > 1:
            raise ValueError("TeraPipe does not support virtual pipeline stages: drop "
                             "--num-layers-per-virtual-pipeline-stage")
        del pp_size
        return forward_backward_terapipe
    assert _ORIGINAL_GET_FORWARD_BACKWARD is not None
    return _ORIGINAL_GET_FORWARD_BACKWARD(*args, **kwargs)


def install() -> None:
    """Point Megatron's get_forward_backward_func (and names that imported it) at TeraPipe.

    The patched getter returns the TeraPipe schedule while a plan is configured, and Megatron's
    own schedule otherwise. Calling install() again is harmless.
    """
    global _ORIGINAL_GET_FORWARD_BACKWARD
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    if _ORIGINAL_GET_FORWARD_BACKWARD is None:
        _ORIGINAL_GET_FORWARD_BACKWARD = schedules.get_forward_backward_func
    _terapipe_or_megatron.__wrapped__ = _ORIGINAL_GET_FORWARD_BACKWARD  # type: ignore[attr-defined]
    schedules.get_forward_backward_func = _terapipe_or_megatron
    pipeline_parallel.get_forward_backward_func = _terapipe_or_megatron
    # Modules that did `from ... import get_forward_backward_func` before install().
    for name in ("megatron.training.training", "megatron.training"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "get_forward_backward_func"):
            module.get_forward_backward_func = _terapipe_or_megatron


def original_get_forward_backward_func() -> Callable:
    from megatron.core.pipeline_parallel import schedules

    return _ORIGINAL_GET_FORWARD_BACKWARD or schedules.get_forward_backward_func
