"""--pipeline-schedule auto and --terapipe-memory-budget in Megatron-LM runs: validation that
names the flag, the choice written into the flags and logged in Megatron's style, plans
within the budget at the first iteration, and fixed slices held against the budget."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from megatron_terapipe.megatron.args.auto_schedule import resolve_auto_schedule, schedule_table
from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from megatron_terapipe.megatron.args.startup_log import WARNING
from megatron_terapipe.megatron.args.inputs_from_flags import planner_inputs
from megatron_terapipe.megatron.args.plans_from_flags import plan_run
from megatron_terapipe.megatron.args.settings import RunSettings, apply_choice
from megatron_terapipe.megatron.wiring import setup_from_args
from megatron_terapipe.planner.cost.stage_memory import GiB
from megatron_terapipe.planner.memory_search import leaner_candidates
from megatron_terapipe.planner.schedule_choice import AutoChoice, ScheduleOption
from harness.inputs.flags import AUTO, SHAPE, gpt3_13b_auto_args, parse, plan_and_report, run_settings


@pytest.mark.parametrize("argv,megatron,flag", [
    (["--terapipe-memory-budget", "lots"], {}, "--terapipe-memory-budget"),
    (["--terapipe-memory-budget", "0GiB"], {}, "--terapipe-memory-budget"),
    (["--terapipe-model-state-memory", "7 parsecs"], {}, "--terapipe-model-state-memory"),
    (["--terapipe-memory-profile", "/nonexistent.json"], {}, "--terapipe-memory-profile"),
    (["--terapipe-auto-trials", "-1"], {}, "--terapipe-auto-trials"),
    (["--terapipe-num-slices", "4"], {}, "--terapipe-num-slices"),
])
def test_bad_auto_and_memory_flags_name_the_flag(argv, megatron, flag):
    with pytest.raises(TeraPipeArgumentError) as info:
        validate_terapipe_args(parse(AUTO + argv, **{**SHAPE, **megatron}))
    assert flag in str(info.value)


def test_memory_budget_needs_terapipe_or_auto():
    with pytest.raises(TeraPipeArgumentError, match="needs --pipeline-schedule terapipe or auto"):
        validate_terapipe_args(parse(["--terapipe-memory-budget", "70GiB"], **SHAPE))


def budget(args):
    """The memory budget the flags give, with the model state per stage."""
    return planner_inputs(RunSettings.from_args(args)).budget


def test_model_state_is_megatrons_accounting_unless_given():
    plain = budget(parse(AUTO, **SHAPE)).model_state
    sharded = budget(parse(AUTO, **SHAPE, use_distributed_optimizer=True,
                           world_size=16)).model_state  # DP 8
    assert sharded[1] == pytest.approx(plain[1] * (6 + 12 / 8) / 18)
    # both hold a vocab x hidden table (embedding; output layer), the last also the final norm
    assert len(plain) == 2 and plain[1] - plain[0] == pytest.approx(18 * 2 * 1024)
    given = budget(parse(AUTO + ["--terapipe-model-state-memory", "3GiB",
                                 "--terapipe-memory-budget", "70GiB"], **SHAPE))
    assert given.model_state == (3 * GiB, 3 * GiB) and given.budget_bytes == 70 * GiB


def test_auto_writes_the_tables_choice_into_the_flags_and_logs_it():
    args = parse(AUTO, **SHAPE)
    table, _ = schedule_table(RunSettings.from_args(args))
    expected = table.auto()
    lines: list[str] = []
    choice = resolve_auto_schedule(RunSettings.from_args(args), log=lines.append)
    apply_choice(args, choice)
    assert choice.chosen.name == expected.chosen.name
    assert args.pipeline_schedule == ("terapipe" if choice.chosen.family == "terapipe" else "1f1b")
    assert lines[0].startswith("> terapipe auto: schedules for seq_length 2048, micro_batch_size 1, "
                               "8 microbatches, 2 pipeline stages")
    rows = lines[1:-1]
    assert len(rows) == len(table.options) and all(r.startswith(">   ") for r in rows)
    assert any("Megatron interleaved, 2 chunks" in r for r in rows)  # 4 layers per stage
    assert any("TeraPipe 1f1b, 2 chunks" in r for r in rows)  # and TeraPipe on them
    assert lines[-1].startswith(f"> terapipe auto: running {choice.chosen.name}")
    assert choice.runner_up.name in lines[-1] and "%" in lines[-1]


def option(name, family, order="1f1b", chunks=1):
    return ScheduleOption(name, family, order, chunks, SimpleNamespace(iteration_time=1.0), (1.0,), True)


def test_apply_choice_sets_what_each_schedule_needs():
    args = parse(AUTO, **SHAPE)
    apply_choice(args, AutoChoice(option("TeraPipe gpipe", "terapipe", "gpipe"), None, None, ""))
    assert (args.pipeline_schedule, args.terapipe_order) == ("terapipe", "gpipe")
    args = parse(AUTO, **SHAPE)
    apply_choice(args, AutoChoice(option("Megatron interleaved, 4 chunks", "megatron", chunks=4),
                                  None, None, ""))
    assert args.pipeline_schedule == "1f1b"
    assert args.virtual_pipeline_model_parallel_size == 4 == args.num_virtual_stages_per_pipeline_rank
    assert args.microbatch_group_size_per_vp_stage == 2  # Megatron's default group: PP
    args = parse(AUTO, **SHAPE)
    apply_choice(args, AutoChoice(option("TeraPipe 1f1b, 2 chunks", "terapipe", chunks=2),
                                  None, None, ""))
    assert (args.pipeline_schedule, args.virtual_pipeline_model_parallel_size) == ("terapipe", 2)
    # TeraPipe's plan keeps the groups its search chose: Megatron's group flag stays unset
    assert getattr(args, "microbatch_group_size_per_vp_stage", None) is None
    args = parse(AUTO, **SHAPE)
    apply_choice(args, AutoChoice(option("Megatron 1F1B", "megatron"), None, None, ""))
    assert args.pipeline_schedule == "1f1b" and args.virtual_pipeline_model_parallel_size is None


def test_auto_refuses_a_budget_nothing_fits_and_an_unmeasured_profile(tmp_path):
    with pytest.raises(TeraPipeArgumentError, match="--terapipe-memory-budget: no pipeline schedule fits"):
        resolve_auto_schedule(RunSettings.from_args(parse(AUTO + ["--terapipe-memory-budget", "1GiB"],
                                                          **SHAPE)), log=lambda line: None)
    args = parse(AUTO + ["--terapipe-cost-model", "profile", "--terapipe-cache-dir", str(tmp_path)],
                 **SHAPE)
    with pytest.raises(TeraPipeArgumentError, match="run once with --pipeline-schedule terapipe"):
        resolve_auto_schedule(RunSettings.from_args(args), log=lambda line: None)


def test_setup_from_args_runs_the_choice():
    """--terapipe-auto-trials 0: the predicted pick, written into the flags; by default
    TeraPipe's schedule is selected to run the trials, with the MeasuredChoice."""
    from megatron_terapipe.megatron.hooks import install, selection

    try:
        args = parse(AUTO + ["--terapipe-auto-trials", "0"], **SHAPE)
        provider = setup_from_args(args)
        assert args.pipeline_schedule in ("terapipe", "1f1b")
        assert (provider is not None) == (args.pipeline_schedule == "terapipe") == selection.selected()
        assert selection.STATE.measured is None
        args = parse(AUTO, **SHAPE)
        assert setup_from_args(args) is not None and args.pipeline_schedule == "terapipe"
        assert selection.STATE.measured is not None and selection.STATE.measured.trials == 2
    finally:
        selection.deselect()
        install.use_slice_attention_in_gpt_models(False)


def test_plans_at_the_first_iteration_fit_the_budget():
    """A budget between the unconstrained plan's peak and the leanest candidate's (4 stages,
    2 rows per microbatch: batch slices hold less): the plan fits it; fixed slices that do not
    are refused, naming the flag."""
    shape = dict(SHAPE, num_layers=16, pipeline_model_parallel_size=4, world_size=4,
                 micro_batch_size=2, global_batch_size=16)
    # W actions in their default places: the budget sits between the plans' own peaks (placed
    # W actions hold more, which would lift the unconstrained peak past the fixed plan's)
    terapipe = ["--pipeline-schedule", "terapipe", "--terapipe-hardware", "a100",
                "--terapipe-wgrad-placement", "off"]
    args = parse(terapipe, **shape)
    _, free = plan_and_report(args, 2048, 2)
    inputs = planner_inputs(run_settings(args, 2048, 2))
    leanest = min(max(inputs.budget.totals(c.result.peak_memory_bytes))
                  for c in leaner_candidates(inputs.cost_model, inputs.space))
    assert leanest < 0.95 * max(free.peak_bytes)
    budget = (max(free.peak_bytes) + leanest) / 2
    argv = terapipe + ["--terapipe-memory-budget", str(int(budget))]
    plan, report = plan_and_report(parse(argv, **shape), 2048, 2)
    assert max(report.peak_bytes) <= budget < max(free.peak_bytes)
    lines = report.lines(plan)
    assert any(line.startswith(">   predicted peak (GiB)") for line in lines)
    assert any(line.startswith(">   memory budget") and "fits" in line for line in lines)
    with pytest.raises(TeraPipeArgumentError,
                       match=r"^--terapipe-memory-budget: the plan from --terapipe-num-slices 1"):
        plan_and_report(parse(argv + ["--terapipe-num-slices", "1"], **shape), 2048, 2)


def test_auto_chooses_terapipe_on_5_chunks_for_gpt3_13b_with_sequence_parallelism(monkeypatch):
    """The headline planning question from Megatron-LM's flags (gpt3-13b, 8 stages x TP 8 with
    --sequence-parallel, 32 sequences of 8192 tokens, 20 GiB, the analytic H100 model): auto
    offers TeraPipe on every chunk count up to 8 and runs the W-placed plan on 5 chunks that
    terapipe-plan prints for the same run (benchmarks/results/planner/virtual_stages_sequence_parallel.json),
    writing the chunks into Megatron's virtual pipeline flags."""
    args = gpt3_13b_auto_args(monkeypatch)
    choice = resolve_auto_schedule(RunSettings.from_args(args), log=lambda line: None)
    assert choice.chosen.name == "TeraPipe 1f1b, 5 chunks" and choice.chosen.fits
    assert choice.chosen.plan.wgrad_after  # W placed
    assert choice.runner_up.name.startswith("Megatron interleaved")
    assert choice.chosen.time < choice.runner_up.time / 1.03
    apply_choice(args, choice)
    assert args.pipeline_schedule == "terapipe" and args.virtual_pipeline_model_parallel_size == 5
    # the run then plans from the flags auto wrote: auto's very plan (its groups included)
    run = RunSettings.from_args(args)
    planned = plan_run(run.for_batch(8192, 1)).plan
    assert planned == replace(choice.chosen.plan, predicted_time=planned.predicted_time)
    assert planned.predicted_time == pytest.approx(choice.chosen.time, rel=1e-9)


FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
FULL_TEXT = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def test_recomputation_is_named_in_the_report():
    """The planner prices full recomputation (its rerun forwards and what its checkpointed
    groups keep: a note naming the flags) and selective recomputation not at all (a warning;
    a budget error says its bytes are an upper bound)."""
    terapipe = ["--pipeline-schedule", "terapipe", "--terapipe-hardware", "a100"]
    plan, report = plan_and_report(parse(terapipe, **SHAPE, **FULL_RECOMPUTE), 2048, 1)
    notes = [line for line in report.lines(plan) if "recomputation" in line]
    assert len(notes) == 1 and notes[0].startswith(">   note: "), notes
    assert (f"({FULL_TEXT}): predicted times include the recomputed forwards and memory counts "
            "what it keeps") in notes[0]
    _, plain = plan_and_report(parse(terapipe, **SHAPE), 2048, 1)
    assert not any("recomputation" in note for note in plain.notes)
    assert report.iteration_time > plain.iteration_time  # the rerun forwards, priced
    assert max(report.peak_bytes) < max(plain.peak_bytes)  # the bytes it saves, counted
    selective = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    inputs = planner_inputs(run_settings(parse(terapipe, **SHAPE, **selective), 2048, 1))
    assert inputs.notes[0].startswith(WARNING) and (
        "(--recompute-granularity selective --recompute-modules core_attn mlp) is not "
        "modelled") in inputs.notes[0]
    assert inputs.cost_model.recomputed_share() == 0

    tight = ["--terapipe-memory-budget", "1GiB"]
    upper_bound = (r"This run recomputes activations \(--recompute-granularity selective\), whose "
                   "memory saving the planner does not model")
    with pytest.raises(TeraPipeArgumentError,
                       match=r"^--terapipe-memory-budget: no pipeline schedule fits.*" + upper_bound):
        resolve_auto_schedule(RunSettings.from_args(parse(
            AUTO + tight, **SHAPE, recompute_granularity="selective")), log=lambda line: None)
    for argv in (terapipe + tight, terapipe + tight + ["--terapipe-num-slices", "2"]):
        with pytest.raises(TeraPipeArgumentError, match=upper_bound):
            plan_and_report(parse(argv, **SHAPE, recompute_granularity="selective"), 2048, 1)
        for counted in (FULL_RECOMPUTE, {}):  # full recomputation's bytes are counted
            with pytest.raises(TeraPipeArgumentError) as error:
                plan_and_report(parse(argv, **SHAPE, **counted), 2048, 1)
            assert "recomputes" not in str(error.value)
