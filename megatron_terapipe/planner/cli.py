"""terapipe-plan: choose token (and batch) slices for a model on a pipeline, and compare them
with no token slicing and with the best uniform slicing.

    terapipe-plan --model gpt3-13b --hardware v100 --pipeline-stages 8 --seq-length 2048
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ..plan import ORDERS, TeraPipePlan
from ..schedule import build_schedule
from .cost_model import AnalyticCostModel, CostModel, ModelDims
from .presets import HARDWARE_PRESETS, MODEL_PRESETS
from .simulator import SimulationResult, simulate
from .slicer import best_uniform_slicing, choose_deferral, slicing_unit, solve_slicing

GiB = 1024 ** 3


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="terapipe-plan",
        description="Plan TeraPipe token slicing for a GPT model on a pipeline and predict its "
                    "iteration time, bubble and memory against no slicing and uniform slicing.")
    m = p.add_argument_group("model (a preset, or its fields; fields override the preset)")
    m.add_argument("--model", choices=sorted(MODEL_PRESETS), help="model preset")
    m.add_argument("--num-layers", type=_positive_int)
    m.add_argument("--hidden-size", type=_positive_int)
    m.add_argument("--num-attention-heads", type=_positive_int)
    m.add_argument("--ffn-hidden-size", type=_positive_int, help="default 4 x hidden size")
    m.add_argument("--num-query-groups", type=_positive_int, help="grouped-query attention")
    m.add_argument("--vocab-size", type=_positive_int,
                   help="vocabulary (presets: 50257); gives the first and last stage their "
                        "embedding and output-layer costs")
    r = p.add_argument_group("run")
    r.add_argument("--seq-length", type=_positive_int, required=True)
    r.add_argument("--micro-batch-size", type=_positive_int, default=1)
    r.add_argument("--num-microbatches", type=_positive_int, default=1,
                   help="microbatches per iteration on each pipeline")
    r.add_argument("--pipeline-stages", type=_positive_int, required=True)
    r.add_argument("--tensor-parallel-size", type=_positive_int, default=1)
    r.add_argument("--order", choices=ORDERS, default="1f1b", help="schedule order (default 1f1b)")
    c = p.add_argument_group("cost model")
    c.add_argument("--hardware", choices=sorted(HARDWARE_PRESETS), default="v100",
                   help="GPU node type (compute estimate and pipeline links; default v100)")
    c.add_argument("--profile", metavar="PATH",
                   help="layer profile JSON (ProfiledCostModel) to use instead of the analytic model")
    s = p.add_argument_group("slicer")
    s.add_argument("--granularity", type=_positive_int, default=8,
                   help="token slices are multiples of this many tokens (default 8)")
    s.add_argument("--defer-wgrad", choices=("auto", "on", "off"), default="auto",
                   help="compute weight gradients in one W action per sequence after its last "
                        "backward cell (auto: when the simulator finds it at least 1%% faster, "
                        "for the memory it holds)")
    s.add_argument("--no-refine", action="store_true",
                   help="skip the simulator-guided hill climb on the fastest plan's slices")
    s.add_argument("--batch-sizes", default="divisors",
                   help="rows per batch slice: divisors (default), all, none, or a list like 1,2,4")
    o = p.add_argument_group("output")
    o.add_argument("--trace", metavar="PATH.json", help="write a Chrome trace of the chosen plan")
    o.add_argument("--png", metavar="PATH.png", help="write a timeline picture of the chosen plan")
    o.add_argument("--save-plan", metavar="PATH.json", help="write the chosen plan as JSON")
    return p


def _model_from_args(args, parser) -> ModelDims:
    base = MODEL_PRESETS[args.model] if args.model else None
    fields = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
              "num_attention_heads": args.num_attention_heads,
              "ffn_hidden_size": args.ffn_hidden_size, "num_query_groups": args.num_query_groups,
              "vocab_size": args.vocab_size}
    given = {k: v for k, v in fields.items() if v is not None}
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


@dataclass
class Row:
    label: str
    plan: TeraPipePlan
    result: SimulationResult


def _simulate(plan: TeraPipePlan, args, cost: CostModel) -> SimulationResult:
    schedule = build_schedule(plan, args.num_microbatches, args.pipeline_stages, args.micro_batch_size)
    return simulate(schedule, cost)


def _slices_text(plan: TeraPipePlan, width: int = 100) -> list[str]:
    def compact(ts) -> str:
        # runs of equal lengths as 256x4
        out, i = [], 0
        while i < len(ts):
            j = i
            while j < len(ts) and ts[j] == ts[i]:
                j += 1
            out.append(f"{ts[i]}" if j - i == 1 else f"{ts[i]}x{j - i}")
            i = j
        return "[" + ", ".join(out) + f"] ({len(ts)} slices)"

    if plan.num_batch_slices == 1:
        return [f"  token slices: {compact(plan.token_slices[0])}"]
    rows = plan.batch_slices or ()
    if plan.uniform_token_slicing:
        return [f"  batch slices: {list(rows)} rows, each cut into {compact(plan.token_slices[0])}"]
    lines = [f"  batch slices: {list(rows)} rows"]
    for r, ts in zip(rows, plan.token_slices):
        lines.append(f"    {r} rows: {compact(ts)}")
    return lines


def _memory_text(peaks: Sequence[float]) -> str:
    values = [p / GiB for p in peaks]
    if len(values) <= 12:
        return " ".join(f"{v:.2f}" for v in values)
    head = " ".join(f"{v:.2f}" for v in values[:6])
    tail = " ".join(f"{v:.2f}" for v in values[-2:])
    return f"{head} ... {tail}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model = _model_from_args(args, parser)
    K, tp = args.pipeline_stages, args.tensor_parallel_size
    if model.num_layers % K:
        parser.error(f"--pipeline-stages {K} does not divide the model's {model.num_layers} layers")
    if model.num_attention_heads % tp:
        parser.error(f"--tensor-parallel-size {tp} does not divide the model's "
                     f"{model.num_attention_heads} attention heads")
    if args.seq_length % args.granularity:
        parser.error(f"--granularity {args.granularity} does not divide --seq-length {args.seq_length}")
    batch_sizes = _batch_sizes(args.batch_sizes, parser)
    hardware = HARDWARE_PRESETS[args.hardware]
    layers_per_stage = model.num_layers // K
    inter_node = tp * K > hardware.gpus_per_node  # some stage boundaries cross nodes
    if args.profile:
        from .profiled import ProfiledCostModel

        link = hardware.inter_node if inter_node else hardware.intra_node
        try:
            cost: CostModel = ProfiledCostModel.load(args.profile, layers_per_stage, link,
                                                     model=model, tensor_parallel=tp)
        except ValueError as exc:
            parser.error(f"--profile: {exc}")
    else:
        cost = AnalyticCostModel(model, hardware, layers_per_stage, tensor_parallel=tp,
                                 inter_node=inter_node)

    started = time.perf_counter()
    try:
        solution = solve_slicing(cost, args.seq_length, args.micro_batch_size, K,
                                 granularity=args.granularity, num_microbatches=args.num_microbatches,
                                 order=args.order, batch_sizes=batch_sizes)
    except ValueError as exc:
        parser.error(f"--batch-sizes/--micro-batch-size: {exc}")
    solve_seconds = time.perf_counter() - started
    uniform, _ = best_uniform_slicing(cost, args.seq_length, args.micro_batch_size, K,
                                      granularity=args.granularity,
                                      num_microbatches=args.num_microbatches, order=args.order)
    def row(label: str, plan: TeraPipePlan, defer: str = args.defer_wgrad) -> Row:
        """The plan in the weight-gradient mode `defer` asks for (auto: `choose_deferral`)."""
        if defer == "auto":
            plan, result = choose_deferral(plan, lambda p: _simulate(p, args, cost),
                                           lambda r: r.iteration_time)
        else:
            plan = replace(plan, defer_wgrad=defer == "on")
            result = _simulate(plan, args, cost)
        return Row(label + (" +W" if plan.defer_wgrad else ""), plan, result)

    rows = [
        row("TeraPipe DP", solution.plan),
        row(f"uniform x{len(uniform.seq_slices)}", uniform),
        # the reference for the speedups: what Megatron's own schedule does
        row("no token slicing", TeraPipePlan([args.seq_length], order=args.order), "off"),
    ]
    # The objective approximates the timeline; the simulator picks (ties keep the DP's plan),
    # then a hill climb on the simulated time polishes the winner's slices and fewer cells
    # replace them where the simulator times them within 0.5% (as `solve` does).
    chosen = min(rows, key=lambda r: r.result.iteration_time)
    if not args.no_refine:
        from .refine import fewer_cells, refine

        unit = slicing_unit(args.seq_length, args.granularity)
        steps = (
            (lambda old, new: f"refined {old.label.split(' +W')[0]}", refine),
            (lambda old, new: f"fewer cells x{len(new.seq_slices)}", fewer_cells),
        )
        for label, step in steps:
            better, _ = step(chosen.plan, cost, args.num_microbatches, K, args.micro_batch_size, unit)
            if better.token_slices != chosen.plan.token_slices:
                rows.insert(0, Row(label(chosen, better) + (" +W" if better.defer_wgrad else ""),
                                   better, _simulate(better, args, cost)))
                chosen = rows[0]
    if not args.no_refine and chosen.plan.defer_wgrad:
        from .refine import place_wgrad_points

        placed, _ = place_wgrad_points(chosen.plan, cost, args.num_microbatches, K,
                                       args.micro_batch_size)
        if placed.wgrad_points:
            rows.insert(0, Row(chosen.label + ", early W", placed, _simulate(placed, args, cost)))
            chosen = rows[0]
    chosen_plan = replace(chosen.plan, order=args.order,
                          predicted_time=chosen.result.iteration_time)

    out = sys.stdout
    print(f"model {model.name}: {model.num_layers} layers, hidden {model.hidden_size}, "
          f"{model.num_attention_heads} heads; {K} stages x {layers_per_stage} layers, TP={tp}", file=out)
    print(f"seq {args.seq_length}, micro batch {args.micro_batch_size}, {args.num_microbatches} "
          f"microbatch(es), order {args.order}, granularity {args.granularity}", file=out)
    print(f"cost model: {cost.describe()}", file=out)
    print(f"chosen plan ({chosen.label}; the fastest simulated, or fewer cells within 0.5% of it):",
          file=out)
    for line in _slices_text(chosen.plan):
        print(line, file=out)
    baseline = rows[-1].result.iteration_time
    wgrad = "deferred to W actions" if chosen.plan.defer_wgrad else "in every backward cell"
    if chosen.plan.wgrad_points:
        wgrad += f"; {chosen.plan.early_w_text()}"
    print(f"  weight gradients: {wgrad}", file=out)
    print(f"{'':24} {'iteration':>12} {'bubble':>7} {'peak GiB/stage':>15} {'speedup':>8}", file=out)
    for each in rows:
        r = each.result
        print(f"{each.label:24} {r.iteration_time * 1e3:>9.2f} ms {100 * r.bubble_fraction:>6.1f}% "
              f"{max(r.peak_memory_bytes) / GiB:>15.2f} {baseline / r.iteration_time:>7.2f}x", file=out)
    print(f"peak GiB per stage (activations + K/V), chosen plan: "
          f"{_memory_text(chosen.result.peak_memory_bytes)}", file=out)
    if not args.profile and max(chosen.result.peak_memory_bytes) > hardware.memory_bytes:
        print(f"warning: peak activations exceed the {hardware.memory_bytes / GiB:.0f} GiB of one "
              f"{args.hardware} GPU before weights and optimizer state", file=out)
    print(f"planner: {solve_seconds:.2f} s, {solution.dp_evaluations} capped DPs; objective "
          f"{solution.objective * 1e3:.2f} ms", file=out)
    if args.trace:
        from .trace import write_chrome_trace

        print(f"trace: {write_chrome_trace(chosen.result, args.trace)}", file=out)
    if args.png:
        from .trace import write_png

        print(f"timeline: {write_png(chosen.result, args.png)}", file=out)
    if args.save_plan:
        with open(args.save_plan, "w") as fh:
            fh.write(chosen_plan.to_json() + "\n")
        print(f"plan: {args.save_plan}", file=out)
    return 0


if __name__ == "__main__":  # python -m megatron_terapipe.planner.cli
    sys.exit(main())
