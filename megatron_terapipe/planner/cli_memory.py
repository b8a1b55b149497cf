"""terapipe-plan's memory options and its table of schedules: the budget per GPU, what the
model state takes (Megatron's accounting, or given), the memory model (the cost model's, or a
measured profile), and the comparison of Megatron's schedules with TeraPipe's."""

from __future__ import annotations

import argparse

from .cost.cost_model import CostModel
from .cost.dims import ModelDims
from .cost.stage_memory import (CostModelMemory, MemoryBudget, MemoryBudgetError, ModelStateConfig,
                     StageMemory, model_state_bytes, parse_bytes)
from .report import auto_text, schedule_table_lines
from .schedule_choice import compare_schedules
from .search import SearchSpace


def _size(text: str) -> float:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: The memory options' help, shared by terapipe-plan and the Megatron-LM flags.
MEMORY_HELP = {
    "budget": "memory per GPU the plan must fit, e.g. 70GiB or 80GB: only plans whose predicted "
              "peak on every stage (activations, K/V, weights, gradients and optimizer state) "
              "fits",
    "model_state": "weights, gradients and optimizer state per GPU (default: Megatron's "
                   "accounting for the model: 18 bytes per parameter in 16-bit training, "
                   "6 + 12/DP with the distributed optimizer)",
    "profile": "memory profile JSON measured on the device (python -m "
               "megatron_terapipe.megatron.measure memory) instead of the cost model's "
               "activation estimate",
}


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory (per GPU)")
    g.add_argument("--memory-budget", type=_size, metavar="SIZE", help=MEMORY_HELP["budget"])
    g.add_argument("--model-state-memory", type=_size, metavar="SIZE",
                   help=MEMORY_HELP["model_state"])
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="data-parallel size, for the distributed optimizer's share (default 1)")
    g.add_argument("--distributed-optimizer", action="store_true",
                   help="the optimizer state is sharded over the data-parallel ranks")
    g.add_argument("--memory-profile", metavar="PATH", help=MEMORY_HELP["profile"])


def memory_from_args(args, model: ModelDims, cost: CostModel,
                     parser: argparse.ArgumentParser) -> tuple[StageMemory, MemoryBudget]:
    """The StageMemory and the budget the flags give; errors name the flag."""
    K, layers = args.pipeline_stages, model.num_layers // args.pipeline_stages
    if args.data_parallel_size <= 0:
        parser.error(f"--data-parallel-size must be positive, got {args.data_parallel_size}")
    if args.model_state_memory is not None:
        state = (float(args.model_state_memory),) * K
    else:
        config = ModelStateConfig(dtype_bytes=int(getattr(cost, "dtype_bytes", 2)),
                                  data_parallel=args.data_parallel_size,
                                  distributed_optimizer=args.distributed_optimizer,
                                  tensor_parallel=args.tensor_parallel_size)
        state = model_state_bytes(model, layers, K, config)
    memory: StageMemory = CostModelMemory(cost)
    if args.memory_profile:
        from .profile.memory_fit import FittedMemory

        try:
            memory = FittedMemory.load(args.memory_profile, layers, model)
        except ValueError as exc:
            parser.error(f"--memory-profile: {exc}")
    try:
        return memory, MemoryBudget(args.memory_budget, state)
    except ValueError as exc:
        parser.error(f"--memory-budget: {exc}")
    raise AssertionError  # unreachable: parser.error exits


def schedule_lines(cost: CostModel, space: SearchSpace, budget: MemoryBudget,
                   layers_per_stage: int) -> tuple[list[str], bool]:
    """The schedule table and the auto choice as lines; False when no schedule fits."""
    table = compare_schedules(cost, space, budget, layers_per_stage)
    lines = schedule_table_lines(table)
    try:
        lines.append(auto_text(table.auto()))
    except MemoryBudgetError:
        lines.append("auto: no schedule fits the memory budget")
        return lines, False
    return lines, True
