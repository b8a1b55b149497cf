"""--pipeline-schedule auto: at start-up, before the model is built, every rank times the
candidate schedules for the run the flags describe (planner/schedule_choice.py: Megatron's 1F1B,
its interleaved 1F1B for each chunk count dividing a stage's layers, TeraPipe's best plan per
order), keeps those that fit --terapipe-memory-budget and runs the fastest, except that
TeraPipe must be predicted at least 3% faster than Megatron's best. The choice is written into
the flags (--pipeline-schedule terapipe and its order, or 1f1b, with virtual pipeline stages
for the interleaved schedule), so the rest of the start-up proceeds as if it had been given;
rank 0 logs the table, the choice, the runner-up and the predicted margin.

Every rank computes the same table from the same flags (the planner is deterministic), so no
collective is needed. The cost model must be known without measuring: analytic, a layer-profile
file, or a cached profile of this shape.
"""

from __future__ import annotations

from typing import Callable

from ...planner.cost.stage_memory import MemoryBudgetError
from ...planner.inputs import PlannerInputs
from ...planner.report import auto_text, megatron_1f1b_time, schedule_row
from ...planner.schedule_choice import TERAPIPE, AutoChoice, ScheduleTable
from .checks import TeraPipeArgumentError
from .flags import num_microbatches, pp_size
from .plan_report import WARNING
from .planner_inputs import planner_inputs
from .profile_cache import profile_cache_path


def _auto_inputs(args) -> PlannerInputs:
    """What the choice is planned from: the flags' inputs, with a cost model known unmeasured."""
    seq, mbs = int(args.seq_length), int(args.micro_batch_size)
    if (getattr(args, "terapipe_cost_model", "analytic") == "profile"
            and not profile_cache_path(args, seq, mbs).is_file()):
        raise TeraPipeArgumentError(
            "--pipeline-schedule auto chooses at start-up, before a layer can be measured, but "
            "--terapipe-cost-model profile has no cached profile for this shape: run once with "
            "--pipeline-schedule terapipe --terapipe-cost-model profile (it caches the profile), "
            "or give --terapipe-cost-model analytic or a layer-profile JSON file")
    return planner_inputs(args, seq, mbs)


def schedule_table_from_args(args, interleaved: bool = True) -> tuple[ScheduleTable, str]:
    """The schedules the flags' run could use, and the cost model's description."""
    inputs = _auto_inputs(args)
    return inputs.schedule_table(interleaved), inputs.cost_model.describe()


def resolve_auto_schedule(args, log: Callable[[str], None] = print,
                          interleaved: bool = True) -> AutoChoice:
    """Choose the schedule for --pipeline-schedule auto and write it into `args`. interleaved:
    whether the run can build model chunks (Megatron-LM can; a script building one model per
    stage cannot). Raises TeraPipeArgumentError when no schedule fits the budget."""
    inputs = _auto_inputs(args)
    table = inputs.schedule_table(interleaved)
    try:
        choice = table.auto()
    except MemoryBudgetError as exc:
        raise TeraPipeArgumentError(f"--terapipe-memory-budget: {exc}") from None
    apply_choice(args, choice)
    for line in auto_log_lines(args, table, choice, inputs.cost_model.describe()):
        log(line)
    for note in inputs.notes:  # a guessed GPU: the choice rests on its numbers
        if note.startswith(WARNING):
            log(f"> terapipe auto: {note}")
    return choice


def apply_choice(args, choice: AutoChoice) -> None:
    """The flags that run `choice`: TeraPipe with its order, or Megatron's schedule, with
    virtual pipeline stages (as Megatron-LM's --num-virtual-stages-per-pipeline-rank sets
    them) for the interleaved one."""
    chosen = choice.chosen
    if chosen.family == TERAPIPE:
        args.pipeline_schedule, args.terapipe_order = "terapipe", chosen.order
        return
    args.pipeline_schedule = "1f1b"
    if chosen.num_chunks > 1:
        args.num_virtual_stages_per_pipeline_rank = chosen.num_chunks
        args.virtual_pipeline_model_parallel_size = chosen.num_chunks
        if getattr(args, "microbatch_group_size_per_vp_stage", None) is None:
            args.microbatch_group_size_per_vp_stage = pp_size(args)


def auto_log_lines(args, table: ScheduleTable, choice: AutoChoice, cost: str) -> list[str]:
    """The table and the choice (as terapipe-plan prints them) in Megatron's `> ...` style."""
    mbs = int(args.micro_batch_size)
    out = [f"> terapipe auto: schedules for seq_length {args.seq_length}, micro_batch_size {mbs}, "
           f"{num_microbatches(args, mbs)} microbatches, {pp_size(args)} pipeline stages "
           f"(predicted by {cost}; {table.budget.describe()}):"]
    base = megatron_1f1b_time(table)
    out += [">   " + schedule_row(o, base) for o in table.options]
    return out + ["> terapipe auto: running " + auto_text(choice).removeprefix("auto: ")]
