"""terapipe-plan: choose token (and batch) slices for a model on a pipeline, and compare them
with no token slicing and with the best uniform slicing. The choosing is `search.search`;
this is its command line.

    terapipe-plan --model gpt3-13b --hardware v100 --pipeline-stages 8 --seq-length 2048
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Iterator, Optional, Sequence

from ...schedule.orders import ORDERS
from .arguments import add_memory_args, inputs_from_options
from ..cost.presets import HARDWARE_PRESETS, MODEL_PRESETS, trust_line
from ..cost.recompute_time import METHODS as RECOMPUTE_METHODS
from ..cost.stage_memory import MemoryBudgetError
from ...plan import TeraPipePlan
from ..evaluate.simulator import SimulationResult
from ..inputs import PlannerInputs
from .report import auto_text, comparison_lines, schedule_table_lines, slices_text
from ..schedule_choice import TERAPIPE, AutoChoice, ScheduleTable
from ..search import SearchResult
from .timeline import short_plan_text

GiB = 1024 ** 3
DEFAULT_GRANULARITY = 8  # the Megatron-LM flags' default too (tests/planner/cli/test_planner_cli.py)


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
    m.add_argument("--ffn-hidden-size", type=_positive_int,
                   help="default 4 x hidden size (with --swiglu: Megatron-LM's int(8 x hidden / 3 "
                        "/ 64) x 64)")
    m.add_argument("--num-query-groups", type=_positive_int, help="grouped-query attention")
    m.add_argument("--group-query-attention", action="store_true",
                   help="Megatron-LM's flag: with --num-query-groups (default 1, as Megatron-LM's)")
    m.add_argument("--swiglu", action="store_true",
                   help="a gated MLP (SwiGLU: fc1 twice as wide), Megatron-LM's flag")
    m.add_argument("--vocab-size", type=_positive_int,
                   help="vocabulary (presets: 50257); gives the first and last stage their "
                        "embedding and output-layer costs")
    _add_run_args(p.add_argument_group("run"))
    c = p.add_argument_group("cost model")
    c.add_argument("--hardware", choices=sorted(HARDWARE_PRESETS), default="v100",
                   help="GPU node type (compute estimate and pipeline links; default v100)")
    c.add_argument("--profile", metavar="PATH",
                   help="layer profile JSON (ProfiledCostModel) to use instead of the analytic model")
    _add_slicer_args(p.add_argument_group("slicer"))
    add_memory_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--trace", metavar="PATH.json",
                   help="write a Chrome trace of auto's choice (what --pipeline-schedule auto runs)")
    o.add_argument("--png", metavar="PATH.png", help="write a timeline picture of auto's choice")
    o.add_argument("--save-plan", metavar="PATH.json",
                   help="write auto's choice as JSON (when auto runs a Megatron schedule: the "
                        "fastest TeraPipe plan that fits)")
    return p


def _add_slicer_args(s) -> None:
    """What the search may choose: slices, weight gradients, chunks, W places."""
    s.add_argument("--granularity", type=_positive_int, default=DEFAULT_GRANULARITY,
                   help="token slices are multiples of this many tokens (default 8)")
    s.add_argument("--defer-wgrad", choices=("auto", "on", "off"), default="on",
                   help="compute parameter gradients in one W action per sequence after its "
                        "last backward cell (on, the default: exact, and one accumulation per "
                        "parameter and sequence however many slices; off: in every backward "
                        "cell, less memory held; auto: when the simulator finds it at least "
                        "1%% faster)")
    s.add_argument("--virtual-stages", "--num-virtual-stages-per-pipeline-rank", default="auto",
                   metavar="auto|V[,V...]",
                   help="model chunks per stage TeraPipe may also run on (virtual stages, "
                        "interleaved: each rank holds V chunks of its layers): auto (default: "
                        "every V that divides a stage's layers), or a list such as 1,5 (1: "
                        "none); each gets its own row in the schedule table")
    s.add_argument("--num-layers-per-virtual-pipeline-stage", type=_positive_int, metavar="N",
                   help="Megatron-LM's: TeraPipe on chunks of N layers (--virtual-stages "
                        "layers-per-stage / N)")
    s.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=_positive_int,
                   metavar="G", help="Megatron-LM's: microbatches per group of the interleaved "
                   "order, for Megatron's interleaved rows and TeraPipe's 1f1b rows on chunks "
                   "(default: Megatron's pipeline size; TeraPipe's chosen by the search)")
    s.add_argument("--wgrad-placement", choices=("auto", "off"), default="auto",
                   help="with deferred weight gradients, plan where each stage runs its W "
                        "actions (in the waits for its neighbours, within --memory-budget) "
                        "when that is faster (auto, the default), or run each right after its "
                        "sequence's last backward (off)")
    s.add_argument("--no-refine", action="store_true",
                   help="skip the simulator-guided hill climb on the fastest plan's slices")
    s.add_argument("--batch-sizes", default="divisors",
                   help="rows per batch slice: divisors (default), all, none, or a list like 1,2,4")


def _add_run_args(r) -> None:
    """The run's shape and parallelism."""
    r.add_argument("--seq-length", type=_positive_int, required=True)
    r.add_argument("--micro-batch-size", type=_positive_int, default=1)
    r.add_argument("--num-microbatches", type=_positive_int,
                   help="microbatches per iteration on each pipeline (default 1, or from "
                        "--global-batch-size)")
    r.add_argument("--global-batch-size", type=_positive_int,
                   help="Megatron-LM's: the microbatches are global / (micro batch x data "
                        "parallel)")
    r.add_argument("--pipeline-stages", "--pipeline-model-parallel-size", type=_positive_int,
                   required=True)
    r.add_argument("--tensor-parallel-size", "--tensor-model-parallel-size", type=_positive_int,
                   default=1)
    r.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's: activations and P2P messages split over the TP ranks, "
                        "token slices multiples of the TP size (nothing changes at TP 1)")
    r.add_argument("--scatter-gather-p2p", action="store_true",
                   help="TeraPipe's messages in TP parts, all-gathered inside the node "
                        "(Megatron-LM's --terapipe-scatter-gather-p2p; Megatron's own schedules "
                        "are priced with whole messages); not with --sequence-parallel")
    r.add_argument("--recompute-method", choices=RECOMPUTE_METHODS,
                   help="Megatron's full activation recomputation (--recompute-granularity full) "
                        "by this method: each backward reruns the forward of every layer "
                        "(uniform) or of the first --recompute-num-layers of each model chunk "
                        "(block); priced for every schedule, in time and in the bytes each "
                        "checkpointed group keeps")
    r.add_argument("--recompute-num-layers", type=_positive_int,
                   help="with --recompute-method (default 1)")
    r.add_argument("--recompute-granularity", choices=("full", "selective"),
                   help="Megatron-LM's: full needs --recompute-method; selective is not priced "
                        "(an error)")
    r.add_argument("--bf16", "--fp16", action="store_true",
                   help="16-bit training, which the cost models price (accepted as Megatron-LM "
                        "scripts give it)")
    r.add_argument("--order", choices=ORDERS, default="1f1b", help="schedule order (default 1f1b)")


def _report(args, inputs: PlannerInputs, result: SearchResult) -> list[str]:
    model, cost, budget = inputs.model, inputs.cost_model, inputs.budget
    hardware = HARDWARE_PRESETS[args.hardware]
    K, tp = args.pipeline_stages, args.tensor_parallel_size
    chosen = result.chosen
    wgrad = "deferred to W actions" if chosen.plan.defer_wgrad else "in every backward cell"
    if chosen.plan.wgrad_points:
        wgrad += f"; {chosen.plan.early_w_text()}"
    lines = [
        f"model {model.name}: {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_attention_heads} heads; {K} stages x {model.num_layers // K} layers, TP={tp}",
        f"seq {args.seq_length}, micro batch {args.micro_batch_size}, {args.num_microbatches} "
        f"microbatch(es), order {args.order}, granularity {args.granularity}",
        f"cost model: {cost.describe()}",
        f"memory: {budget.describe()}",
        f"TeraPipe {args.order} on one model chunk ({chosen.label}; the fastest simulated"
        f"{' that fits' if budget.budget_bytes else ''}, or fewer cells within 0.5% of it):",
        *slices_text(chosen.plan),
        f"  weight gradients: {wgrad}",
        *comparison_lines(result, budget),
    ]
    if (not args.profile and budget.budget_bytes is None
            and max(budget.totals(chosen.result.peak_memory_bytes)) > hardware.memory_bytes):
        lines.append(f"warning: the predicted peak exceeds the {hardware.memory_bytes / GiB:.0f} "
                     f"GiB of one {args.hardware} GPU: give --memory-budget to plan within it")
    lines.append(f"planner: {result.slicing.solve_seconds:.2f} s, {result.slicing.dp_evaluations} "
                 f"capped DPs; objective {result.slicing.objective * 1e3:.2f} ms")
    return lines


def _drawn(choice: Optional[AutoChoice]) -> tuple[Optional[SimulationResult], str, str]:
    """The schedule --trace and --png show (auto's choice), its label and its picture's title."""
    if choice is None:
        return None, "", ""
    option = choice.chosen
    plan = f": {short_plan_text(option.plan)}" if option.plan is not None else ""
    return option.result, f"{option.name}: auto's choice", option.name + plan


def _saved(table: ScheduleTable,
           choice: Optional[AutoChoice]) -> tuple[Optional[TeraPipePlan], str]:
    """The plan --save-plan writes, and its label: auto's choice when it is TeraPipe's, else
    the fastest TeraPipe row that fits."""
    if choice is not None and choice.chosen.plan is not None:
        return choice.chosen.plan, f"{choice.chosen.name}: auto's choice"
    best = table.best(TERAPIPE)
    if choice is None or best is None or best.plan is None:
        return None, ""
    return best.plan, (f"{best.name}: the fastest TeraPipe schedule that fits; auto runs "
                       f"{choice.chosen.name}")


def _write_outputs(args, table: ScheduleTable, choice: Optional[AutoChoice]) -> Iterator[str]:
    """--trace, --png and --save-plan: a line naming each file and what it shows, once written."""
    drawn, label, title = _drawn(choice)
    plan, plan_label = _saved(table, choice)
    for flag, path, what, kind in (("--trace", args.trace, drawn, ""),
                                   ("--png", args.png, drawn, ""),
                                   ("--save-plan", args.save_plan, plan, "TeraPipe ")):
        if path and what is None:
            yield f"{flag} {path}: not written, no {kind}schedule fits the memory budget"
    if args.trace and drawn is not None:
        from .timeline import write_chrome_trace

        yield f"trace: {write_chrome_trace(drawn, args.trace)} ({label})"
    if args.png and drawn is not None:
        from .timeline import write_png

        yield f"timeline: {write_png(drawn, args.png, title=title)} ({label})"
    if args.save_plan and plan is not None:
        with open(args.save_plan, "w") as fh:
            fh.write(plan.to_json() + "\n")
        yield f"plan: {args.save_plan} ({plan_label})"


def _size_text(nbytes: float) -> str:
    """A size as the flags take it back: whole GiB or MiB, else bytes."""
    for unit, size in (("GiB", GiB), ("MiB", 2 ** 20)):
        if nbytes >= size and nbytes % size == 0:
            return f"{int(nbytes // size)}{unit}"
    return str(int(nbytes))


def megatron_flags(args, choice: AutoChoice) -> str:
    """The flags that run auto's choice in a Megatron-LM script beside the question's own
    flags (model, parallelism, batch, recomputation): the schedule (and its model chunks), and
    for TeraPipe the --terapipe-*
    flags that give the start-up planner terapipe-plan's cost model, budget and options, so
    that it plans what the table shows (tests/planner/cli/test_planner_cli.py checks that it does)."""
    chosen = choice.chosen
    flags = ["--pipeline-schedule", "terapipe" if chosen.family == TERAPIPE else "1f1b"]
    if chosen.num_chunks > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(chosen.num_chunks)]
    if chosen.placement == "v":  # both ends on rank 0: untied (docs/megatron-lm.md)
        flags += ["--terapipe-virtual-placement", "v", "--untie-embeddings-and-output-weights"]
    lead = ("Megatron-LM flags for it (beside the question's own model, parallelism, batch and "
            "recomputation flags): ")
    if chosen.family != TERAPIPE:
        return lead + " ".join(flags)
    flags += ["--terapipe-order", chosen.order]
    flags += (["--terapipe-cost-model", args.profile] if args.profile
              else ["--terapipe-hardware", args.hardware])
    options = (("--terapipe-granularity", args.granularity != DEFAULT_GRANULARITY,
                str(args.granularity)),
               ("--terapipe-defer-wgrad", args.defer_wgrad != "on", args.defer_wgrad),
               ("--terapipe-wgrad-placement", args.wgrad_placement != "auto", args.wgrad_placement),
               ("--terapipe-scatter-gather-p2p", args.scatter_gather_p2p, None),
               ("--terapipe-memory-budget", args.memory_budget is not None,
                args.memory_budget and _size_text(args.memory_budget)),
               ("--terapipe-model-state-memory", args.model_state_memory is not None,
                args.model_state_memory and _size_text(args.model_state_memory)),
               ("--terapipe-memory-profile", args.memory_profile is not None, args.memory_profile))
    for flag, given, value in options:
        flags += [flag] + ([value] if value is not None else []) if given else []
    unmatched = [o for o, given in (("--no-refine", args.no_refine),
                                    ("--batch-sizes", args.batch_sizes != "divisors")) if given]
    return lead + " ".join(flags) + (
        f" (the flags have no {' or '.join(unmatched)}: the plan at start-up may differ)"
        if unmatched else "")


def schedule_lines(table: ScheduleTable) -> tuple[list[str], Optional[AutoChoice]]:
    """The schedule table and the auto choice as lines, and the choice (None: nothing fits)."""
    lines = schedule_table_lines(table)
    try:
        choice = table.auto()
    except MemoryBudgetError:
        lines.append("auto: no schedule fits the memory budget")
        return lines, None
    lines.append(auto_text(choice))
    return lines, choice


def _progress() -> Callable[[str], None]:
    """Progress lines on stderr (the answer stays alone on stdout), with seconds since start:
    a large question plans for a minute or more."""
    start = time.perf_counter()

    def say(what: str) -> None:
        print(f"terapipe-plan: {time.perf_counter() - start:6.1f} s  {what}", file=sys.stderr,
              flush=True)
    return say


def trust_text(args, inputs: PlannerInputs) -> str:
    """How far the table can be trusted: the profile's own error on its held-out cells, or the
    preset's error on what it was fitted on (presets.py)."""
    if not args.profile:
        return trust_line(args.hardware)
    errors = dict(getattr(getattr(inputs.cost_model, "fit", None), "holdout_error", {}) or {})
    cells = errors.pop("cells", 0)
    if not cells or not errors:
        return (f"profile {args.profile}: measured, with no held-out cells: its own fit error "
                "is unknown")
    worst = max(e["max_relative"] for e in errors.values())
    return (f"profile {args.profile}: its fit predicts {cells} held-out cells within "
            f"{worst * 100:.0f}%")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    inputs = inputs_from_options(args, parser)
    say = _progress()
    say(f"planning TeraPipe {args.order} on one model chunk")
    try:
        result = inputs.search()
    except MemoryBudgetError as exc:
        result = None
        print(f"{args.order}: {exc}")
    if result is not None:
        for line in _report(args, inputs, result):
            print(line)
    say("timing Megatron's schedules")
    table = inputs.schedule_table(progress=lambda row: say(f"planning {row}"), v_rows=True)
    say("done")
    lines, choice = schedule_lines(table)
    for line in lines:
        print(line)
    print(trust_text(args, inputs))
    if choice is not None:
        print(megatron_flags(args, choice))
    for line in _write_outputs(args, table, choice):
        print(line)
    return 0 if choice is not None else 1


if __name__ == "__main__":
    sys.exit(main())
