"""The planner's memory inputs from the flags: the budget per GPU (--terapipe-memory-budget),
what the model state takes (--terapipe-model-state-memory, or Megatron's accounting from the
model, precision, data parallelism and --use-distributed-optimizer), and the StageMemory
(--terapipe-memory-profile, or the cost model's estimate)."""

from __future__ import annotations

from typing import Optional

from ...planner.cost.stage_memory import MemoryBudget, ModelStateConfig, StageMemory, model_state_bytes
from .cost_from_args import model_dims_from_args
from .flags import data_parallel_size, dtype_bytes, layers_per_stage, pp_size, size_flag, tp_size
from .checks import TeraPipeArgumentError


def _size(args, name: str) -> Optional[float]:
    try:
        return size_flag(args, name)
    except ValueError as exc:
        raise TeraPipeArgumentError(f"--{name.replace('_', '-')}: {exc}") from None


def model_state_from_args(args) -> tuple[float, ...]:
    """Weights, gradients and optimizer state per stage: the flag's size on every stage, or
    Megatron's accounting (memory.ModelStateConfig) of this model on this parallel layout."""
    given = _size(args, "terapipe_model_state_memory")
    K = pp_size(args)
    if given is not None:
        return (given,) * K
    config = ModelStateConfig(dtype_bytes=dtype_bytes(args), data_parallel=data_parallel_size(args),
                              distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
                              tensor_parallel=tp_size(args),
                              untie_embeddings=bool(getattr(args, "untie_embeddings_and_output_weights",
                                                            False)))
    return model_state_bytes(model_dims_from_args(args), layers_per_stage(args), K, config)


def budget_from_args(args) -> MemoryBudget:
    """The budget the flags give (None: no limit), with the model state per stage."""
    return MemoryBudget(_size(args, "terapipe_memory_budget"), model_state_from_args(args))


def stage_memory_from_args(args) -> Optional[StageMemory]:
    """The measured memory profile the flags name, or None (the cost model's estimate)."""
    path = getattr(args, "terapipe_memory_profile", None)
    if not path:
        return None
    from ...planner.profile.memory_fit import FittedMemory

    try:
        return FittedMemory.load(path, layers_per_stage(args), model_dims_from_args(args))
    except ValueError as exc:
        raise TeraPipeArgumentError(f"--terapipe-memory-profile: {exc}") from None
