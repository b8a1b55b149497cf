"""The TeraPipe flags for Megatron-LM scripts, and what Megatron-LM's own flags mean for them.

`add_terapipe_args(parser)` works as Megatron-LM's `extra_args_provider` (combine it with a
script's own provider with `combine_extra_args`). The readers below take Megatron-LM's argument
names (seq_length, tensor_model_parallel_size, ...); a name a script does not define counts as
unset.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Optional

SCHEDULES = ("1f1b", "terapipe", "auto")
from ...schedule.orders import ORDERS  # noqa: E402  the registry: --terapipe-order choices
COST_MODELS = ("analytic", "profile")
HARDWARE_CHOICES = ("auto", "v100", "a100", "h100")
DEFAULT_GRANULARITY = 8
DEFAULT_PROFILE_POINTS = 4


def add_terapipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the TeraPipe flags to a Megatron-LM (or any argparse) parser and return it.

    Usable as Megatron-LM's `extra_args_provider`. Adding them twice is harmless.
    """
    if "--pipeline-schedule" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(title="terapipe")
    group.add_argument("--pipeline-schedule", choices=SCHEDULES, default="1f1b",
                       help="1f1b: Megatron's own (interleaved with virtual stages); terapipe: "
                            "token-slice pipelining; auto: the one predicted fastest within "
                            "--terapipe-memory-budget, chosen at start-up")
    group.add_argument("--terapipe-order", choices=ORDERS, default="1f1b",
                       help="order of cells: 1f1b (low memory) or gpipe (the paper's order)")
    slices = group.add_mutually_exclusive_group()
    slices.add_argument("--terapipe-slices", type=int, nargs="+", default=None, metavar="TOKENS",
                        help="explicit token slice lengths, summing to --seq-length")
    slices.add_argument("--terapipe-num-slices", type=int, default=None, metavar="N",
                        help="cut each sequence into N near-equal slices (multiples of "
                             "--terapipe-granularity)")
    group.add_argument("--terapipe-defer-wgrad", choices=("auto", "on", "off"), default="on",
                       help="compute each sequence's parameter gradients in one W action after "
                            "its last backward cell instead of in every cell (on, the default: "
                            "exact, and one accumulation per parameter and sequence however "
                            "many slices; off: in every cell, less memory held until the W "
                            "action; auto: when the cost model's simulation finds it at least "
                            "1%% faster)")
    group.add_argument("--terapipe-cost-model", default="analytic",
                       metavar="{analytic,profile,PATH}",
                       help="cost model of the DP slicer (used when no slices are given) and of "
                            "the logged prediction: analytic (model shape + --terapipe-hardware), "
                            "profile (measure a layer on this device once, cached in "
                            "--terapipe-cache-dir), or a layer-profile JSON file")
    group.add_argument("--terapipe-hardware", choices=HARDWARE_CHOICES, default="auto",
                       help="GPU preset of the analytic cost model (auto: from the device name)")
    group.add_argument("--terapipe-granularity", type=int, default=DEFAULT_GRANULARITY,
                       metavar="TOKENS", help="slice lengths are multiples of this many tokens")
    group.add_argument("--terapipe-cache-dir", default=None, metavar="DIR",
                       help="where measured layer profiles are cached (default: "
                            "$XDG_CACHE_HOME/megatron_terapipe or ~/.cache/megatron_terapipe)")
    group.add_argument("--terapipe-profile-points", type=int, default=DEFAULT_PROFILE_POINTS,
                       metavar="N", help="slice lengths and contexts measured per axis with "
                                         "--terapipe-cost-model profile (keep it small)")
    group.add_argument("--terapipe-cuda-graphs", action="store_true",
                       help="capture each compute action (a cell's forward, its backward, a W "
                            "action) as a CUDA graph at the second iteration and replay it "
                            "after, so a cell's host work does not grow with the slices (needs "
                            "CUDA; not with --overlap-grad-reduce)")
    group.add_argument("--terapipe-cpu", action="store_true",
                       help="run Megatron-LM's training script on CPU processes with gloo "
                            "(launcher only; needs --clip-grad 0.0; see megatron/hooks/lm_cpu.py)")
    _add_memory_args(group)
    group.add_argument("--terapipe-trace", default=None, metavar="PATH",
                       help="write Chrome traces: the simulated plan to PATH's "
                            "'.simulated.json' sibling, the measured second iteration to PATH")
    return parser


def _add_memory_args(group) -> None:
    from ...planner.cli_inputs import MEMORY_HELP

    for flag, metavar, key in (("--terapipe-memory-budget", "SIZE", "budget"),
                               ("--terapipe-model-state-memory", "SIZE", "model_state"),
                               ("--terapipe-memory-profile", "PATH", "profile")):
        group.add_argument(flag, default=None, metavar=metavar, help=MEMORY_HELP[key])


def combine_extra_args(*providers: Optional[Callable]) -> Callable:
    """One `extra_args_provider` that applies each of `providers` in turn (None skipped).

    E.g. `pretrain(..., extra_args_provider=combine_extra_args(my_args, add_terapipe_args))`.
    """
    chain = [p for p in providers if p is not None]

    def provider(parser):
        for p in chain:
            result = p(parser)
            parser = parser if result is None else result
        return parser

    provider.providers = tuple(chain)  # type: ignore[attr-defined]
    return provider


def terapipe_selected(args) -> bool:
    return getattr(args, "pipeline_schedule", "1f1b") == "terapipe"


def auto_selected(args) -> bool:
    """--pipeline-schedule auto, not yet resolved (auto_schedule.resolve_auto_schedule)."""
    return getattr(args, "pipeline_schedule", "1f1b") == "auto"


def size_flag(args, name: str):
    """The bytes a size flag (--terapipe-memory-budget, ...) gives, or None when unset.
    Raises ValueError for a malformed size."""
    from ...planner.cost.stage_memory import parse_bytes

    text = getattr(args, name, None)
    return None if text in (None, "") else parse_bytes(str(text))


def int_or_none(value) -> Optional[int]:
    return None if value is None else int(value)


def tp_size(args) -> int:
    return int(getattr(args, "tensor_model_parallel_size", 1) or 1)


def pp_size(args) -> int:
    return int(getattr(args, "pipeline_model_parallel_size", 1) or 1)


def cp_size(args) -> int:
    return int(getattr(args, "context_parallel_size", 1) or 1)


def world_size(args) -> int:
    return int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", 1))


def data_parallel_size(args) -> int:
    dp = getattr(args, "data_parallel_size", None)
    if dp:
        return int(dp)
    return max(1, world_size(args) // (tp_size(args) * pp_size(args) * cp_size(args)))


def slice_multiple(args) -> int:
    """What sequence parallelism asks of every slice length: a multiple of the TP size."""
    return tp_size(args) if getattr(args, "sequence_parallel", False) else 1


def granularity(args) -> int:
    return int(getattr(args, "terapipe_granularity", DEFAULT_GRANULARITY) or 1)


def slice_unit(args) -> int:
    """Tokens every slice length is a multiple of: the granularity, and the TP size under SP."""
    g, multiple = granularity(args), slice_multiple(args)
    return g * multiple // math.gcd(g, multiple)


def layers_per_stage(args) -> int:
    return max(1, math.ceil(int(args.num_layers) / pp_size(args)))


def num_microbatches(args, micro_batch_size: int) -> int:
    """Microbatches per iteration: --num-microbatches if the script has it, else from the
    global batch size (Megatron-LM: global / (micro x data parallel))."""
    n = getattr(args, "num_microbatches", None)
    if n:
        return int(n)
    gbs = getattr(args, "global_batch_size", None)
    if gbs:
        return max(1, int(gbs) // (micro_batch_size * data_parallel_size(args)))
    return 1


def dtype_name(args) -> str:
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


def dtype_bytes(args) -> int:
    return 4 if dtype_name(args) == "fp32" else 2


def defer_wgrad(args) -> Optional[bool]:
    """--terapipe-defer-wgrad as the planner takes it: None for auto."""
    return {"on": True, "off": False}.get(getattr(args, "terapipe_defer_wgrad", "on"))


def attention_backend(args) -> str:
    """--attention-backend by name (Megatron-LM parses it to an AttnBackend); auto when unset."""
    value = getattr(args, "attention_backend", None)
    return "auto" if value is None else str(getattr(value, "name", value))


def slices_given(args) -> bool:
    """Whether the flags fix the slices (--terapipe-slices or --terapipe-num-slices)."""
    return (bool(getattr(args, "terapipe_slices", None))
            or getattr(args, "terapipe_num_slices", None) is not None)
