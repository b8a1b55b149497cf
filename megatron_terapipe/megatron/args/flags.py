"""The TeraPipe flags for Megatron-LM scripts.

`add_terapipe_args(parser)` works as Megatron-LM's `extra_args_provider` (combine it with a
script's own provider with `combine_extra_args`). The defaults are TeraPipeSettings' (the
parsed flags, settings.py); `RunSettings.from_args` reads what the parser made.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from ...schedule.orders import ORDERS  # the registry: --terapipe-order choices
from .settings import DEFER_WGRAD, TeraPipeSettings

SCHEDULES = ("1f1b", "terapipe", "auto")
COST_MODELS = ("analytic", "profile")
HARDWARE_CHOICES = ("auto", "v100", "a100", "h100")
DEFAULTS = TeraPipeSettings()


def add_terapipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the TeraPipe flags to a Megatron-LM (or any argparse) parser and return it.

    Usable as Megatron-LM's `extra_args_provider`. Adding them twice is harmless.
    """
    if "--pipeline-schedule" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(title="terapipe")
    group.add_argument("--pipeline-schedule", choices=SCHEDULES, default=DEFAULTS.schedule,
                       help="1f1b: Megatron's own (interleaved with virtual stages); terapipe: "
                            "token-slice pipelining; auto: the layout predicted fastest within "
                            "--terapipe-memory-budget, then the schedule measured fastest on "
                            "the first iterations (--terapipe-auto-trials)")
    group.add_argument("--terapipe-auto-trials", type=int, default=DEFAULTS.auto_trials,
                       metavar="N",
                       help="with --pipeline-schedule auto: time each shortlisted schedule on N "
                            "training iterations (after one warm-up each, in interleaved rounds) "
                            "and keep the fastest measured; 0 keeps the predicted pick")
    _add_order_args(group)
    _add_slice_args(group)
    _add_wgrad_args(group)
    group.add_argument("--terapipe-cost-model", default=DEFAULTS.cost_model,
                       metavar="{analytic,profile,PATH}",
                       help="cost model of the DP slicer (used when no slices are given) and of "
                            "the logged prediction: analytic (model shape + --terapipe-hardware), "
                            "profile (measure a layer on this device once, cached in "
                            "--terapipe-cache-dir), or a layer-profile JSON file")
    group.add_argument("--terapipe-hardware", choices=HARDWARE_CHOICES, default=DEFAULTS.hardware,
                       help="GPU preset of the analytic cost model (auto: from the device name)")
    group.add_argument("--terapipe-granularity", type=int, default=DEFAULTS.granularity,
                       metavar="TOKENS", help="slice lengths are multiples of this many tokens")
    group.add_argument("--terapipe-cache-dir", default=None, metavar="DIR",
                       help="where measured layer profiles are cached (default: "
                            "$XDG_CACHE_HOME/megatron_terapipe or ~/.cache/megatron_terapipe)")
    group.add_argument("--terapipe-profile-points", type=int, default=DEFAULTS.profile_points,
                       metavar="N", help="slice lengths and contexts measured per axis with "
                                         "--terapipe-cost-model profile (keep it small)")
    group.add_argument("--terapipe-cuda-graphs", action="store_true",
                       help="capture each compute action (a cell's forward, its backward, a W "
                            "action) as a CUDA graph at the second iteration and replay it "
                            "after, so a cell's host work does not grow with the slices (needs "
                            "CUDA; not with --overlap-grad-reduce)")
    group.add_argument("--terapipe-scatter-gather-p2p", action="store_true",
                       help="each TP rank sends 1/TP of every stage-to-stage message and the "
                            "receiving stage's TP ranks all-gather it (Megatron-LM's old "
                            "scatter/gather optimisation): TP times fewer bytes over the pipeline "
                            "link for one all-gather in the TP group; not with --sequence-parallel, "
                            "whose messages are split already")
    _add_run_args(group)
    _add_memory_args(group)
    group.add_argument("--terapipe-trace", default=None, metavar="PATH",
                       help="write Chrome traces: the simulated plan to PATH's "
                            "'.simulated.json' sibling, the measured second iteration to PATH")
    return parser


def _add_run_args(group) -> None:
    """Flags about the run around the schedule: the model Megatron's schedule gets, the CPU."""
    group.add_argument("--terapipe-slice-aware-model", action="store_true",
                       help="under Megatron's own schedule (--pipeline-schedule 1f1b), build GPT "
                            "models with TeraPipe's slice-aware attention, as terapipe and auto "
                            "do: the same attention on both sides of a comparison")
    group.add_argument("--terapipe-cpu", action="store_true",
                       help="run Megatron-LM's training script on CPU processes with gloo "
                            "(launcher only; see megatron/platform/lm_cpu.py)")


def _add_order_args(group) -> None:
    """The order of the cells, and where model chunks sit."""
    group.add_argument("--terapipe-order", choices=ORDERS, default=DEFAULTS.order,
                       help="order of cells: 1f1b (low memory) or gpipe (the paper's order)")
    group.add_argument("--terapipe-virtual-placement", choices=("ring", "v"), default=None,
                       help="where TeraPipe puts the 2 model chunks of "
                            "--num-virtual-stages-per-pipeline-rank 2: ring (Megatron's, chunk c "
                            "of rank k is virtual stage cK + k; the default) or v (Zero Bubble's "
                            "ZB-V: rank k holds virtual stages k and 2K - 1 - k, the embedding "
                            "and the loss on rank 0). Unset, --pipeline-schedule auto may choose "
                            "a V itself where the flags fix no model chunks")


def _add_slice_args(group) -> None:
    """The three ways to fix the slices, one at a time (else the planner chooses)."""
    slices = group.add_mutually_exclusive_group()
    slices.add_argument("--terapipe-slices", type=int, nargs="+", default=None, metavar="TOKENS",
                        help="explicit token slice lengths, summing to --seq-length")
    slices.add_argument("--terapipe-num-slices", type=int, default=None, metavar="N",
                        help="cut each sequence into N near-equal slices (multiples of "
                             "--terapipe-granularity)")
    slices.add_argument("--terapipe-edge-slices", type=int, nargs=4, default=None,
                        metavar=("FIRST", "SLICES", "LAST", "LAST_SLICES"),
                        help="whole sequences, but the first FIRST microbatches cut into SLICES "
                             "near-equal slices and the last LAST into LAST_SLICES (edge "
                             "slicing, as the planner chooses it; 1f1b order, one model chunk)")


def _add_wgrad_args(group) -> None:
    """Where weight gradients are computed: deferred to W actions, and where those run."""
    group.add_argument("--terapipe-defer-wgrad", choices=("auto", "on", "off"),
                       default=next(k for k, v in DEFER_WGRAD.items() if v is DEFAULTS.defer_wgrad),
                       help="compute each sequence's parameter gradients in one W action after "
                            "its last backward cell instead of in every cell (on, the default: "
                            "exact, and one accumulation per parameter and sequence however "
                            "many slices; off: in every cell, less memory held until the W "
                            "action; auto: when the cost model's simulation finds it at least "
                            "1%% faster)")
    group.add_argument("--terapipe-wgrad-placement", choices=("auto", "off"),
                       default="auto" if DEFAULTS.wgrad_placement else "off",
                       help="with deferred weight gradients, the planner places each stage's W "
                            "actions in its waits for its neighbours, within "
                            "--terapipe-memory-budget, where that is faster (auto, the default; "
                            "not with --rampup-batch-size, whose microbatch count changes); "
                            "off: each right after its sequence's last backward")


def _add_memory_args(group) -> None:
    from ...planner.cli.arguments import MEMORY_HELP

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

