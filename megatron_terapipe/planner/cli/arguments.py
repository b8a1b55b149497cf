"""PlannerInputs from terapipe-plan's options: the model (a preset, or its fields), the cost
model (the analytic model of a GPU preset, or a --profile), the search space with its stage
memory (--memory-profile), and the budget (--memory-budget) with the model state (given, or
Megatron's accounting). Megatron-LM's flags are the other adapter (megatron/args/
inputs_from_flags.py); both build through inputs.py. Errors name the option (parser.error)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Optional

from ...plan import SliceGrid, SliceNames
from ..cost.cost_model import CostModel
from ..cost.dims import Hardware, ModelDims
from ..cost.presets import HARDWARE_PRESETS, MODEL_PRESETS
from ..cost.recompute_time import FullRecompute
from ..cost.stage_memory import MemoryBudget, ModelStateConfig, parse_bytes
from ..inputs import PlannerInputs, layer_cost_model, memory_budget, stage_memory
from ..search import SearchSpace, stages_cross_nodes
from ..slicer import resolve_batch_sizes


#: How slice-length errors name terapipe-plan's options.
CLI_SLICE_NAMES = SliceNames(seq_length="--seq-length", granularity="--granularity",
                             tensor_parallel="--tensor-parallel-size",
                             tp_multiple="--tensor-parallel-size {tp}")


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
    g.add_argument("--distributed-optimizer", "--use-distributed-optimizer", action="store_true",
                   help="the optimizer state is sharded over the data-parallel ranks")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="the last stage holds its own output layer (as Megatron's flag; "
                        "default: tied to the first stage's embedding)")
    g.add_argument("--memory-profile", metavar="PATH", help=MEMORY_HELP["profile"])


def inputs_from_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> PlannerInputs:
    """What the planner starts from, as terapipe-plan's options give it."""
    _megatron_batch_and_recompute(args, parser)
    model = _model_from_args(args, parser)
    _check_shape(args, model, parser)
    batch_sizes = _batch_sizes(args.batch_sizes, parser)
    try:
        resolve_batch_sizes(batch_sizes, args.micro_batch_size)
    except ValueError as exc:
        parser.error(f"--batch-sizes/--micro-batch-size: {exc}")
    hardware = HARDWARE_PRESETS[args.hardware]
    if args.scatter_gather_p2p and args.sequence_parallel:
        parser.error("--scatter-gather-p2p splits each stage-to-stage message over the TP ranks, "
                     "which --sequence-parallel does already: drop --scatter-gather-p2p")
    cost = _cost_model(args, model, hardware, parser)
    try:
        memory = stage_memory(model, args.pipeline_stages, args.memory_profile,
                              tensor_parallel=args.tensor_parallel_size,
                              sequence_parallel=args.sequence_parallel,
                              recompute=getattr(cost, "recompute", None),
                              dtype_bytes=int(getattr(cost, "dtype_bytes", 2)))
    except ValueError as exc:
        parser.error(f"--memory-profile: {exc}")
    space = SearchSpace(args.seq_length, args.micro_batch_size, args.pipeline_stages,
                        args.num_microbatches, args.order, args.granularity,
                        multiple_of=_tp_multiple(args), batch_sizes=batch_sizes,
                        defer_wgrad={"on": True, "off": False}.get(args.defer_wgrad),
                        refine=not args.no_refine, memory=memory,
                        virtual_stages=_virtual_stages(args, model, parser),
                        place_wgrad=args.wgrad_placement == "auto",
                        microbatch_group=args.microbatch_group_size_per_virtual_pipeline_stage)
    return PlannerInputs(model, cost, space, _budget(args, model, cost, parser))


def _megatron_batch_and_recompute(args, parser) -> None:
    """Megatron-LM's --global-batch-size and --recompute-granularity, as its scripts give
    them: the microbatch count (global / (micro batch x data parallel), Megatron-LM's rule;
    written into args.num_microbatches), and full recomputation through --recompute-method."""
    if args.global_batch_size is not None:
        per = args.micro_batch_size * args.data_parallel_size
        if args.global_batch_size % per:
            parser.error(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                         f"--micro-batch-size x --data-parallel-size ({per}), as Megatron-LM "
                         "needs")
        count = args.global_batch_size // per
        if args.num_microbatches not in (None, count):
            parser.error(f"--num-microbatches {args.num_microbatches} and --global-batch-size "
                         f"{args.global_batch_size} (that is {count} microbatches): give one")
        args.num_microbatches = count
    elif args.num_microbatches is None:
        args.num_microbatches = 1
    if args.recompute_granularity == "selective":
        parser.error("--recompute-granularity selective: terapipe-plan prices Megatron's full "
                     "recomputation only; drop it (every activation is then counted: an upper "
                     "bound), or use --recompute-granularity full with --recompute-method")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        parser.error("--recompute-granularity full needs --recompute-method uniform or block "
                     "(as Megatron-LM)")


def _tp_multiple(args) -> int:
    """What --sequence-parallel asks of every slice: a multiple of the TP size (as
    RunShape.tp_multiple for Megatron-LM's flags)."""
    return args.tensor_parallel_size if args.sequence_parallel else 1


def _virtual_stages(args, model: ModelDims, parser) -> tuple[int, ...]:
    """--virtual-stages: every chunk count that divides a stage's layers (auto), or the list
    given, each of which must divide them; or Megatron-LM's --num-layers-per-virtual-pipeline-
    stage N: chunks of N layers."""
    layers = model.num_layers // args.pipeline_stages
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is not None:
        if args.virtual_stages != "auto":
            parser.error("--num-layers-per-virtual-pipeline-stage and --virtual-stages (or "
                         "--num-virtual-stages-per-pipeline-rank): give one")
        if layers % per_chunk:
            parser.error(f"--num-layers-per-virtual-pipeline-stage {per_chunk} does not divide "
                         f"the {layers} layers of a stage")
        return (layers // per_chunk,) if per_chunk < layers else ()
    if args.virtual_stages == "auto":
        return tuple(v for v in range(2, layers + 1) if layers % v == 0)
    try:
        given = tuple(int(v) for v in args.virtual_stages.split(",") if v.strip())
    except ValueError:
        given = ()
    if not given or any(v < 1 or layers % v for v in given):
        parser.error(f"--virtual-stages: expected auto or model chunk counts that divide the "
                     f"{layers} layers of a stage, such as 1,{layers}; got {args.virtual_stages!r}")
    return tuple(v for v in given if v > 1)


def _budget(args, model: ModelDims, cost: CostModel, parser) -> MemoryBudget:
    if args.data_parallel_size <= 0:
        parser.error(f"--data-parallel-size must be positive, got {args.data_parallel_size}")
    config = ModelStateConfig(dtype_bytes=int(getattr(cost, "dtype_bytes", 2)),
                              data_parallel=args.data_parallel_size,
                              distributed_optimizer=args.distributed_optimizer,
                              tensor_parallel=args.tensor_parallel_size,
                              untie_embeddings=args.untie_embeddings_and_output_weights)
    try:
        return memory_budget(model, args.pipeline_stages, args.memory_budget,
                             args.model_state_memory, config)
    except ValueError as exc:
        parser.error(f"--memory-budget: {exc}")
    raise AssertionError  # unreachable: parser.error exits


def _model_from_args(args, parser) -> ModelDims:
    base = MODEL_PRESETS[args.model] if args.model else None
    fields = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
              "num_attention_heads": args.num_attention_heads,
              "ffn_hidden_size": args.ffn_hidden_size, "num_query_groups": args.num_query_groups,
              "vocab_size": args.vocab_size}
    given = {k: v for k, v in fields.items() if v is not None}
    if args.group_query_attention:
        given.setdefault("num_query_groups", 1)  # Megatron-LM's default
    if args.swiglu:
        given["gated_linear_unit"] = True
        hidden = given.get("hidden_size") or (base.hidden_size if base else None)
        if "ffn_hidden_size" not in given and hidden:
            given["ffn_hidden_size"] = int(4 * hidden * 2 / 3 / 64) * 64  # Megatron-LM's
    if base is None:
        missing = [f"--{k.replace('_', '-')}" for k in ("num_layers", "hidden_size", "num_attention_heads")
                   if k not in given]
        if missing:
            parser.error(f"give --model or all of --num-layers, --hidden-size, --num-attention-heads "
                         f"(missing {', '.join(missing)})")
        given.setdefault("name", "custom")
        try:
            return ModelDims(**given)
        except ValueError as exc:
            parser.error(f"--hidden-size/--num-attention-heads: {exc}")
    try:
        return replace(base, **given, name=base.name if not given else f"{base.name} (modified)")
    except ValueError as exc:
        parser.error(f"--model {args.model} with overrides: {exc}")
    raise AssertionError  # unreachable: parser.error exits


def _batch_sizes(text: str, parser):
    if text in ("divisors", "all", "none"):
        return text
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--batch-sizes: expected divisors, all, none or a comma list of rows, got {text!r}")
    if not sizes:
        parser.error("--batch-sizes: empty list")
    return sizes


def _check_shape(args, model: ModelDims, parser) -> None:
    """Stop with an error naming the flag if the model does not split as asked."""
    K, tp = args.pipeline_stages, args.tensor_parallel_size
    if model.num_layers % K:
        parser.error(f"--pipeline-stages {K} does not divide the model's {model.num_layers} layers")
    if model.num_attention_heads % tp:
        parser.error(f"--tensor-parallel-size {tp} does not divide the model's "
                     f"{model.num_attention_heads} attention heads")
    try:
        SliceGrid(args.granularity, _tp_multiple(args), names=CLI_SLICE_NAMES).units(args.seq_length)
    except ValueError as exc:
        parser.error(str(exc))


def _recompute(args, parser) -> Optional[FullRecompute]:
    """--recompute-method and --recompute-num-layers (Megatron's full recomputation)."""
    if args.recompute_method is None:
        if args.recompute_num_layers is not None:
            parser.error("--recompute-num-layers needs --recompute-method uniform or block")
        return None
    return FullRecompute(args.recompute_method, args.recompute_num_layers or 1)


def _cost_model(args, model: ModelDims, hardware: Hardware, parser) -> CostModel:
    """The analytic model of `hardware`, or the --profile; links as `search.pipeline_link`
    (Megatron's rank order: a stage's TP and DP ranks lie between neighbouring stages)."""
    K, tp = args.pipeline_stages, args.tensor_parallel_size
    cross_nodes = stages_cross_nodes(tp * args.data_parallel_size, K, hardware.gpus_per_node)
    try:
        return layer_cost_model(model, hardware, K, tensor_parallel=tp, dtype_bytes=2,
                                cross_nodes=cross_nodes, profile_path=args.profile,
                                sequence_parallel=args.sequence_parallel,
                                scatter_gather=args.scatter_gather_p2p,
                                recompute=_recompute(args, parser))
    except ValueError as exc:
        parser.error(f"--profile: {exc}")
    raise AssertionError  # unreachable: parser.error exits
