"""The one measuring command: `python -m megatron_terapipe.megatron.measure {layers,memory}`.

Both subcommands measure one model shape on this device and save a profile the planner reads:
`layers` a layer profile (times per cell, and the pipeline's edges with --vocab-size) for
terapipe-plan --profile and --terapipe-cost-model; `memory` a memory profile for
--memory-profile and --terapipe-memory-profile. Without a subcommand, `layers` runs.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence

from ...planner.cost.dims import ModelDims
from .clocks import TIMINGS
from .device_setup import POSITION_EMBEDDING_TYPES

#: (namespace, model) -> (the fitted profile with a .save(path), lines to print)
Measure = Callable[[argparse.Namespace, ModelDims], tuple[object, list[str]]]


def _measure_layers(args: argparse.Namespace, model: ModelDims) -> tuple[object, list[str]]:
    from ...planner.profile.least_squares import fit_layer_times
    from ...planner.profile.time_samples import default_grid
    from .layers import measure_layer_times, summary_lines

    batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    cells = default_grid(args.seq_length, batch_sizes, args.granularity, args.points)
    measured = measure_layer_times(model, cells, dtype=args.dtype, repeats=args.repeats,
                                   position_embedding_type=args.position_embedding_type,
                                   timing=args.timing)
    fit = fit_layer_times(measured)
    return fit, summary_lines(fit, measured)


def _measure_memory(args: argparse.Namespace, model: ModelDims) -> tuple[object, list[str]]:
    from ...planner.profile.memory_fit import FittedMemory
    from .memory import measure_memory

    measured = measure_memory(model, args.seq_length, granularity=args.granularity,
                              dtype=args.dtype, position_embedding_type=args.position_embedding_type)
    fit = FittedMemory.fit(measured)
    cells = sum(len(v) for v in measured.cells.values())
    return fit, [f"memory fit: within {100 * fit.max_fit_error:.2f}% of the {cells} measured cells"]


def _shape_args(p: argparse.ArgumentParser, vocab_help: str, vocab_required: bool) -> None:
    """The model shape and run options both subcommands share."""
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--num-query-groups", type=int)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=vocab_required, help=vocab_help)
    p.add_argument("--granularity", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=POSITION_EMBEDDING_TYPES,
                   help="for the embedding (default learned_absolute, as Megatron's GPTModel)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_terapipe.megatron.measure",
                                description="Measure a model shape on this device and save a "
                                            "profile for the planner.")
    sub = p.add_subparsers(dest="command", required=True)
    layers = sub.add_parser("layers", help="layer times on token slices (and the edges): a "
                                           "layer profile for terapipe-plan --profile")
    _shape_args(layers, "also measure the embedding and the output layer + loss (the first and "
                        "last stage's edges) with this vocabulary (Megatron's padded size)", False)
    layers.add_argument("--batch-sizes", default="1", help="comma list, e.g. 1,2,4")
    layers.add_argument("--points", type=int, default=6, help="lengths and contexts per axis")
    layers.add_argument("--repeats", type=int, default=5)
    layers.add_argument("--timing", choices=TIMINGS, default="wall",
                        help="wall: the host's time, device synchronised (eager cells); device: "
                             "the GPU's time, the host's launches queued ahead (cells replayed "
                             "from CUDA graphs, --terapipe-cuda-graphs; needs CUDA)")
    layers.add_argument("--out", required=True, help="layer profile JSON to write")
    layers.set_defaults(measure=_measure_layers, kind="profile")
    memory = sub.add_parser("memory", help="what a stage keeps for backward: a memory profile "
                                           "for terapipe-plan --memory-profile")
    _shape_args(memory, "the vocabulary (the edges' activations)", True)
    memory.add_argument("--out", required=True, help="memory profile JSON to write")
    memory.set_defaults(measure=_measure_memory, kind="memory profile")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("layers", "memory", "-h", "--help"):
        argv.insert(0, "layers")  # the layer profile is what most runs need
    p = build_parser()
    args = p.parse_args(argv)
    try:
        model = ModelDims(num_layers=1, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads,
                          ffn_hidden_size=args.ffn_hidden_size,
                          num_query_groups=args.num_query_groups, vocab_size=args.vocab_size)
        if args.command == "layers":
            [int(x) for x in args.batch_sizes.split(",") if x.strip()]
            if args.timing == "device":
                import torch

                if not torch.cuda.is_available():
                    raise ValueError("--timing device measures GPU time and this machine has "
                                     "no CUDA device: use --timing wall (the default)")
    except ValueError as exc:
        p.error(str(exc))
    fit, lines = args.measure(args, model)
    fit.save(args.out)
    for line in lines:
        print(line)
    print(f"{args.kind}: {args.out}")
    return 0
