"""Plans from the flags (parsed once: settings.py), in one process: explicit slices
(--terapipe-slices), uniform slices (--terapipe-num-slices), or the planner's search on the
flags' cost model (within --terapipe-memory-budget when given); each with the simulator's
prediction for the start-up report. ArgsPlanProvider (plan_provider.py) adds the collectives
that give every rank rank 0's plan."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from ...plan import SliceGrid, TeraPipePlan
from ...planner.cost.stage_memory import MemoryBudget, MemoryBudgetError, format_size
from ...planner.inputs import PlannerInputs
from ...planner.search import SearchResult, choose_deferral
from ...planner.cli.timeline import write_chrome_trace
from ...planner.virtual_search import NoAllowedGroupError
from ...schedule.build import allowed_group
from .flags import COST_MODELS
from .startup_log import PlanReport, attention_text
from .inputs_from_flags import budget_error, planner_inputs
from .checks import check_edge_microbatches
from .settings import (RunSettings, RunShape, TeraPipeArgumentError, TeraPipeSettings,
                       as_flag_error)

#: () -> what the planner starts from (the cost model measured or not, the space, the budget)
InputsSource = Callable[[], PlannerInputs]


def wants_profile(flags: TeraPipeSettings) -> bool:
    """Whether planning needs a measured profile: the profile cost model and no fixed slices."""
    return flags.cost_model == "profile" and not flags.slices_given


@dataclass
class PlannedRun:
    """A plan from the flags, its report, and what it was planned with."""

    plan: TeraPipePlan
    report: PlanReport
    inputs: Optional[PlannerInputs]  # None: fixed slices, no model shape, no prediction


def plan_run(run: RunSettings, inputs: Optional[InputsSource] = None) -> PlannedRun:
    """The plan the flags select for `run`'s batch (RunSettings.for_batch), and the
    simulator's view of it. `inputs` defaults to the flags' inputs without measuring. Errors
    in what the prediction starts from (a bad cost-model file, a budget the plan cannot meet)
    are raised, fixed slices or not; fixed slices on a model the flags do not describe run
    without a prediction when no flag needs one (`_refuse_unpredicted`)."""
    flags, shape = run.terapipe, run.shape
    predicted = run.model_given or not flags.slices_given
    if not predicted:
        _refuse_unpredicted(flags)
    inputs = inputs or (lambda: planner_inputs(run))
    chunks = run.support.virtual_stages  # Megatron's virtual pipeline stages: model chunks
    group = run.microbatch_group  # the planner's inputs carry it too (inputs_from_flags.py)
    check_edge_microbatches(flags, shape)  # this batch's count (checks.py: the flags' batch)
    fixed = fixed_plan(flags, run.grid, shape.seq_length)
    given = inputs() if predicted else None
    searched = None
    if fixed is None:
        searched = _search(given, chunks, shape, flags.virtual_placement)
        plan = searched.plan
        source = f"DP slicer (granularity {flags.granularity}), simulator-checked"
        if plan.edge_slices:  # the planner's edge walk beat the DP slicer's plan
            source = f"edge slicing (granularity {flags.granularity}), simulator-checked"
        if chunks > 1:
            source += f", on {chunks} virtual stages per rank"
            source += " in a V" if flags.virtual_placement == "v" else ""
    else:
        source, plan = fixed
        in_v = chunks > 1 and flags.virtual_placement == "v"
        split = run.support.stage_layers  # a V's chunks as model/v_layout.py builds them
        plan = replace(plan, virtual_stages=chunks, virtual_group=group,
                       virtual_placement="v" if in_v else "ring",
                       chunk_layers=split.v_chunk_layers if in_v and split else ())
        check_group(plan, shape)
    if flags.defer_wgrad is not None:  # on (the default) or off; auto: chosen below
        plan = replace(plan, defer_wgrad=flags.defer_wgrad)
    report = PlanReport(shape.seq_length, shape.micro_batch_size, shape.num_microbatches,
                        shape.pipeline_parallel, source, "none",
                        notes=list(given.notes) if given else [],
                        attention=attention_text(run.attention_backend))
    report.notes += group_notes(run, group)
    if given is None:
        report.notes.append("no prediction: the flags give no model shape (--num-layers, "
                            "--hidden-size, --num-attention-heads)")
    else:
        plan = _predict(given, plan, source, searched, report)
        _check_fixed_plan_fits(plan, source, report, given.budget, shape)
    return PlannedRun(replace(plan, predicted_time=report.iteration_time), report, given)


def _refuse_unpredicted(flags: TeraPipeSettings) -> None:
    """Fixed slices on a model the flags do not describe (a script without Megatron-LM's model
    flags) run as given, without a prediction; refused when a flag needs the prediction."""
    needs = [(flag, fix) for flag, fix, given in (
        ("--terapipe-memory-budget", "drop it", flags.memory_budget is not None),
        ("--terapipe-defer-wgrad auto", "choose --terapipe-defer-wgrad on or off",
         flags.defer_wgrad is None),
        (f"--terapipe-cost-model {flags.cost_model}", "drop it",
         flags.cost_model not in COST_MODELS),
    ) if given]
    if needs:
        flag, fix = needs[0]
        raise TeraPipeArgumentError(
            f"{flag} needs the plan's predicted time and memory, which need the model shape "
            "(--num-layers, --hidden-size, --num-attention-heads), but the flags give none: "
            f"give them, or {fix}")


def _predict(inputs: PlannerInputs, plan: TeraPipePlan, source: str,
             searched: Optional[SearchResult], report: PlanReport) -> TeraPipePlan:
    """Fill `report` with the simulator's view of `plan` (the searched one, or the fixed one
    with its weight-gradient mode chosen); the plan that runs."""
    model, space, budget = inputs.cost_model, inputs.space, inputs.budget
    report.cost_model = model.describe()
    if searched is not None:  # the search has chosen the weight-gradient mode
        result = searched.chosen.result
    else:
        chosen = choose_deferral(model, space, [(source, plan)])[0]
        plan, result = chosen.plan, chosen.result
    # Megatron's 1F1B as it runs: whole messages (scatter-gather is TeraPipe's)
    base = space.simulate(TeraPipePlan([space.seq_length], order="1f1b", defer_wgrad=False),
                          model.without_scatter_gather())
    report.iteration_time, report.bubble = result.iteration_time, result.bubble_fraction
    report.baseline_time, report.baseline_bubble = base.iteration_time, base.bubble_fraction
    report.peak_bytes = budget.totals(result.peak_memory_bytes)
    report.budget_bytes, report.model_state = budget.budget_bytes, budget.model_state
    return plan


def _search(inputs: PlannerInputs, chunks: int, shape: RunShape, placement: str = "ring"):
    """The planner's search (on `chunks` model chunks per stage: Megatron's virtual pipeline
    stages, in the space's microbatch groups when the flag fixes them, round the ring or in a
    V), within the memory budget when one is given."""
    try:
        if chunks > 1:
            return inputs.search_virtual(inputs.space.order, chunks, placement)
        return inputs.search()
    except MemoryBudgetError as exc:
        raise budget_error(exc, shape) from None
    except NoAllowedGroupError as exc:
        raise TeraPipeArgumentError(f"{GROUP_FLAG} {inputs.space.microbatch_group}: {exc}; give "
                                    "a larger group, or drop the flag (the planner chooses the "
                                    "groups)") from None


#: Megatron-LM's flag for the microbatches per group of the interleaved order.
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def group_notes(run: RunSettings, group: Optional[int]) -> list[str]:
    """What the start-up report says about Megatron's group flag, when given."""
    given = run.shape.microbatch_group
    if given is None:
        return []
    if group is not None:
        return [f"microbatch groups of {group} from {GROUP_FLAG}"]
    where = ("the gpipe order runs every forward first" if run.support.virtual_stages > 1
             else "no virtual pipeline stages")
    return [f"{GROUP_FLAG} {given} does not apply: {where}"]


def check_group(plan: TeraPipePlan, shape: RunShape) -> None:
    """Fixed slices in the flag's groups: every group (and a shorter last one) must hold at
    least one unit (cell) per pipeline stage, counted in token slices: TeraPipe's rule
    (schedule/build.py: allowed_group), looser than Megatron's group >= pipeline size."""
    group, M, K = plan.virtual_group, shape.num_microbatches, shape.pipeline_parallel
    if group is None or allowed_group(group, M, K, plan.num_cells):
        return
    cells = plan.num_cells
    allowed = [g for g in range(1, M + 1) if allowed_group(g, M, K, cells)]
    raise TeraPipeArgumentError(
        f"{GROUP_FLAG} {group}: with {cells} cell{'s' * (cells > 1)} per microbatch (token "
        f"slices x batch slices) that is {group * cells} units per group and "
        f"{M % group * cells} in the last of {M} microbatches, but every group needs at least "
        f"{K} (one per pipeline stage): give one of {', '.join(map(str, allowed))}, cut each "
        "sequence into more slices, or drop the flag")


def _check_fixed_plan_fits(plan: TeraPipePlan, source: str, report: PlanReport,
                           budget: MemoryBudget, shape: RunShape) -> None:
    """Slices the flags fix must fit the budget too (the planner's search keeps within it)."""
    if budget.budget_bytes is None or report.peak_bytes is None:
        return
    worst = max(range(len(report.peak_bytes)), key=lambda k: report.peak_bytes[k])
    if report.peak_bytes[worst] > budget.budget_bytes:
        hint = "use --terapipe-order 1f1b, " if plan.order == "gpipe" else ""
        raise budget_error(
            f"the plan from {source} does not fit the memory budget of "
            f"{format_size(budget.budget_bytes)} per GPU: it peaks at "
            f"{format_size(report.peak_bytes[worst])} on stage {worst} (weights, gradients and "
            f"optimizer state included); cut the sequence into more slices, {hint}give more "
            "memory, or let the planner choose (drop the fixed slices)", shape)


def fixed_plan(flags: TeraPipeSettings, grid: SliceGrid,
               seq_length: int) -> Optional[tuple[str, TeraPipePlan]]:
    """(where from, plan) when the flags fix the slices; None when the planner chooses. The
    slices are checked against this batch's sequence and the TP size (sequence parallelism);
    uniform ones are cut in whole slice units."""
    with as_flag_error():
        if flags.slices:
            grid.check_sum(flags.slices, seq_length, against=f"the sequence has {seq_length}")
            grid.check_tp_multiple([flags.slices])
            return "--terapipe-slices", TeraPipePlan(seq_slices=list(flags.slices), order=flags.order)
        if flags.edge_slices is not None:
            first, n_first, last, n_last = flags.edge_slices
            cut = [list(grid.uniform(seq_length, n).seq_slices) for n in (n_first, n_last)]
            return (f"--terapipe-edge-slices {first} {n_first} {last} {n_last} (uniform)",
                    TeraPipePlan([seq_length], order=flags.order,
                                 edge_slices=((first, cut[0]), (last, cut[1]))))
        if flags.num_slices is None:
            return None
        return (f"--terapipe-num-slices {flags.num_slices} (uniform)",
                grid.uniform(seq_length, flags.num_slices, order=flags.order))


def simulated_trace_path(path: str) -> Path:
    """Where --terapipe-trace PATH puts the simulated timeline: PATH's '.simulated' sibling."""
    p = Path(path)
    return p.with_name(p.stem + ".simulated" + (p.suffix or ".json"))


def write_simulated_trace(run: PlannedRun, path: str) -> Path:
    """The simulator's timeline of the planned run as a Chrome trace (needs its cost model)."""
    assert run.inputs is not None
    result = run.inputs.space.simulate(run.plan, run.inputs.cost_model)
    return write_chrome_trace(result, simulated_trace_path(path))

