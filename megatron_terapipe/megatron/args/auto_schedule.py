"""--pipeline-schedule auto: at start-up, before the model is built, every rank times the
candidate schedules for the run the flags describe (planner/schedule_choice.py: Megatron's 1F1B,
its interleaved 1F1B for each chunk count dividing a stage's layers, TeraPipe's best plan per
order), keeps those that fit --terapipe-memory-budget and runs the fastest, except that
TeraPipe must be predicted at least 3% faster than Megatron's best. `settings.apply_choice`
writes the choice into Megatron-LM's flags (--pipeline-schedule terapipe and its order, or
1f1b, with virtual pipeline stages for the interleaved schedule), so the rest of the start-up
proceeds as if it had been given; rank 0 logs the table, the choice, the runner-up and the
predicted margin.

Every rank computes the same table from the same flags (the planner is deterministic), so no
collective is needed. The cost model must be known without measuring: analytic, a layer-profile
file, or a cached profile of this shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ...planner.cost.stage_memory import MemoryBudgetError
from ...planner.inputs import PlannerInputs
from ...planner.cli.report import auto_text, megatron_1f1b_time, schedule_row
from ...planner.schedule_choice import (TERAPIPE, AutoChoice, ScheduleTable,
                                         interleaved_chunk_counts)
from .checks import v_layout_problem
from .startup_log import WARNING
from .inputs_from_flags import budget_error, planner_inputs
from .profile_cache import profile_cache_path
from .settings import RunSettings, TeraPipeArgumentError

#: TeraPipe's chunk counts tried at start-up (each is a search of its own, about a second for
#: a large model: terapipe-plan's table for gpt3-175b on 8 stages, 32 microbatches, took
#: 5.6 s with 2-4 chunks, 5.2 s with 2-6 and 7.2 s with 2-12 on a 2-core machine); Megatron's
#: interleaved rows take every divisor. 8 keeps gpt3-13b's 5 chunks on 8 stages, its fastest
#: layout at 8 and 32 microbatches.
MAX_TERAPIPE_CHUNKS = 8


def _auto_inputs(run: RunSettings, interleaved: bool = True) -> PlannerInputs:
    """What the choice is planned from: the flags' inputs, with a cost model known unmeasured;
    where the run can build model chunks, TeraPipe on virtual stages too (each chunk count up
    to MAX_TERAPIPE_CHUNKS that divides a stage's layers, as Megatron's interleaved rows)."""
    if run.terapipe.cost_model == "profile" and not profile_cache_path(run).is_file():
        raise TeraPipeArgumentError(
            "--pipeline-schedule auto chooses at start-up, before a layer can be measured, but "
            "--terapipe-cost-model profile has no cached profile for this shape: run once with "
            "--pipeline-schedule terapipe --terapipe-cost-model profile (it caches the profile), "
            "or give --terapipe-cost-model analytic or a layer-profile JSON file")
    inputs = planner_inputs(run)
    if not interleaved:
        return calibrated(run, inputs)
    chunks = tuple(v for v in interleaved_chunk_counts(inputs.layers_per_stage)
                   if v <= MAX_TERAPIPE_CHUNKS)
    if fixed_layout(run) > 1:  # the flags fix the model chunks: auto chooses within them
        chunks = (fixed_layout(run),)
    inputs = calibrated(run, inputs)
    return replace(inputs, space=replace(inputs.space, virtual_stages=chunks))


def calibrated(run: RunSettings, inputs: PlannerInputs) -> PlannerInputs:
    """`inputs` on the calibration an earlier run of this shape saved (auto_trials.py), if
    any, with a note saying so."""
    from .auto_trials import calibration_path, load_calibration

    if run.terapipe.auto_trials == 0:
        return inputs
    path = calibration_path(run)
    calibration = load_calibration(path) if path.is_file() else None
    if calibration is None:
        return inputs
    return replace(inputs, cost_model=calibration.apply(inputs.cost_model),
                   notes=[*inputs.notes, f"calibrated on an earlier run's trials ({path})"])


def fixed_layout(run: RunSettings) -> int:
    """The model chunks per stage the flags fix (--num-virtual-stages-per-pipeline-rank or
    --num-layers-per-virtual-pipeline-stage); 0 when they leave the layout to auto."""
    return run.support.virtual_stages if run.support.virtual_stages > 1 else 0


def offers_v(run: RunSettings, args) -> bool:
    """Whether auto may choose 2 model chunks in a V as the layout itself: the flags fix no
    model chunks and no placement, and nothing in them refuses a V (checks.v_layout_problem:
    untied embeddings, no MTP, an even layer split, ...)."""
    return (not fixed_layout(run) and not run.terapipe.placement_given
            and run.shape.pipeline_parallel >= 2 and not v_layout_problem(run, args))


def layout_table(run: RunSettings, inputs: PlannerInputs, interleaved: bool,
                 offer_v: bool = False) -> ScheduleTable:
    """The schedule table; only the fixed layout's rows when the flags fix one (in a V,
    --terapipe-virtual-placement v: TeraPipe's V rows, Megatron having no V). offer_v: TeraPipe
    on 2 chunks in a V among the layouts too (offers_v)."""
    in_v = run.terapipe.virtual_placement == "v"
    table = inputs.schedule_table(interleaved, v_rows=in_v or offer_v)
    fixed = fixed_layout(run)
    if not fixed:
        return table
    placement = "v" if in_v else "ring"
    return replace(table, options=tuple(
        o for o in table.options if o.num_chunks == fixed
        and (o.placement == placement if o.family == TERAPIPE else not in_v)))


def schedule_table(run: RunSettings, interleaved: bool = True) -> tuple[ScheduleTable, str]:
    """The schedules the flags' run could use, and the cost model's description; no model
    chunks where the flags split the layers unevenly (the chunks' time models assume equal
    chunks)."""
    interleaved = interleaved and not run.support.uneven_layers
    inputs = _auto_inputs(run, interleaved)
    return layout_table(run, inputs, interleaved), inputs.cost_model.describe()


def resolve_auto_schedule(run: RunSettings, log: Callable[[str], None] = print,
                          interleaved: bool = True) -> AutoChoice:
    """Choose the schedule for --pipeline-schedule auto (settings.apply_choice writes it into
    Megatron-LM's flags). interleaved: whether the run can build model chunks (Megatron-LM
    can; a script building one model per stage cannot). Raises TeraPipeArgumentError when no
    schedule fits the budget."""
    return predicted_choice(run, log, interleaved).choice


@dataclass
class PredictedChoice:
    """What auto predicts at start-up: the planner's inputs, the table and its pick."""

    inputs: PlannerInputs
    table: ScheduleTable
    choice: AutoChoice


def predicted_choice(run: RunSettings, log: Callable[[str], None] = print,
                     interleaved: bool = True, offer_v: bool = False) -> PredictedChoice:
    """resolve_auto_schedule's choice with what it was predicted from; logs the table.
    offer_v: the V among the layouts (offers_v)."""
    interleaved = interleaved and not run.support.uneven_layers  # as schedule_table
    inputs = _auto_inputs(run, interleaved)
    table = layout_table(run, inputs, interleaved, offer_v)
    try:
        choice = table.auto()
    except MemoryBudgetError as exc:
        raise budget_error(exc, run.shape) from None
    for line in auto_log_lines(run, table, choice, inputs.cost_model.describe()):
        log(line)
    for note in inputs.notes:  # a guessed GPU: the choice rests on its numbers
        if note.startswith(WARNING):
            log(f"> terapipe auto: {note}")
    return PredictedChoice(inputs, table, choice)


def auto_log_lines(run: RunSettings, table: ScheduleTable, choice: AutoChoice,
                   cost: str) -> list[str]:
    """The table and the choice (as terapipe-plan prints them) in Megatron's `> ...` style."""
    shape = run.shape
    out = [f"> terapipe auto: schedules for seq_length {shape.seq_length}, micro_batch_size "
           f"{shape.micro_batch_size}, {shape.num_microbatches} microbatches, "
           f"{shape.pipeline_parallel} pipeline stages (predicted by {cost}; "
           f"{table.budget.describe()}):"]
    base = megatron_1f1b_time(table)
    out += [">   " + schedule_row(o, base) for o in table.options]
    return out + ["> terapipe auto: running " + auto_text(choice).removeprefix("auto: ")]
