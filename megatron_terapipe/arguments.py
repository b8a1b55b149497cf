"""Megatron-LM style command-line flags for TeraPipe, and the plan they select.

`add_terapipe_args(parser)` works as Megatron-LM's `extra_args_provider`. `ArgsPlanProvider`
turns the parsed flags into a plan the first time the schedule runs for a given shape
(the config-time hook), identically on every rank.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

from .plan import TeraPipePlan

SCHEDULES = ("1f1b", "terapipe")


def add_terapipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the TeraPipe flags to a Megatron-LM (or any argparse) parser and return it."""
    group = parser.add_argument_group(title="terapipe")
    group.add_argument("--pipeline-schedule", choices=SCHEDULES, default="1f1b",
                       help="1f1b: Megatron's own schedule (interleaved with virtual stages); "
                            "terapipe: token-slice pipelining")
    group.add_argument("--terapipe-order", choices=("1f1b", "gpipe"), default="1f1b",
                       help="order of cells: 1f1b (low memory) or gpipe (the paper's order)")
    group.add_argument("--terapipe-slices", type=int, nargs="+", default=None, metavar="TOKENS",
                       help="explicit token slice lengths, summing to --seq-length")
    group.add_argument("--terapipe-num-slices", type=int, default=None, metavar="N",
                       help="cut each sequence into N near-equal slices")
    group.add_argument("--terapipe-cost-model", default="analytic", metavar="{analytic,profile,PATH}",
                       help="cost model for the DP slicer when no slices are given: analytic, "
                            "profile (measure on this device, cached), or a profile JSON file")
    group.add_argument("--terapipe-granularity", type=int, default=8, metavar="TOKENS",
                       help="slice lengths are multiples of this many tokens")
    group.add_argument("--terapipe-trace", default=None, metavar="PATH",
                       help="write a Chrome trace of the plan's simulated and measured timeline")
    return parser


@dataclass
class ArgsPlanProvider:
    """Plans from parsed flags, one per (seq_length, micro_batch_size), computed once."""

    args: argparse.Namespace
    plans: dict[tuple[int, int], TeraPipePlan] = field(default_factory=dict)

    def plan_for(self, seq_length: int, micro_batch_size: int) -> TeraPipePlan:
        key = (seq_length, micro_batch_size)
        if key not in self.plans:
            self.plans[key] = plan_from_args(self.args, seq_length, micro_batch_size)
        return self.plans[key]


def plan_from_args(args: argparse.Namespace, seq_length: int, micro_batch_size: int) -> TeraPipePlan:
    """Explicit slices, or uniform slices; the DP slicer otherwise."""
    order = getattr(args, "terapipe_order", "1f1b")
    if getattr(args, "terapipe_slices", None):
        slices = list(args.terapipe_slices)
        if sum(slices) != seq_length:
            raise ValueError(
                f"--terapipe-slices {' '.join(map(str, slices))} sum to {sum(slices)} tokens but "
                f"the sequence has {seq_length}: give lengths that sum to {seq_length}")
        return TeraPipePlan(seq_slices=slices, order=order)
    if getattr(args, "terapipe_num_slices", None):
        granularity = getattr(args, "terapipe_granularity", 1) or 1
        unit = granularity if seq_length % granularity == 0 else 1
        return TeraPipePlan.uniform(seq_length, args.terapipe_num_slices, order=order,
                                    multiple_of=unit)
    raise ValueError(
        "--pipeline-schedule terapipe needs --terapipe-slices or --terapipe-num-slices "
        "(planning from a cost model is not available in this build)")
