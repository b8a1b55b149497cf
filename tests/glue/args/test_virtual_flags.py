"""Megatron-LM's virtual pipeline flags under --pipeline-schedule terapipe: the plan from the
flags runs as many model chunks per stage as Megatron builds (validate_args turns
--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank into
virtual_pipeline_model_parallel_size), searched or fixed, and what cannot run is refused at
start-up with the flag named."""

from __future__ import annotations

import pytest

from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from megatron_terapipe.schedule import LoweredSchedule, build_schedule
from harness.inputs.flags import parse, plan_and_report

#: 8 layers on 2 pipeline stages: 4 per stage, 2 chunks of 2 (Megatron-LM's validated args)
VPP = dict(num_layers=8, virtual_pipeline_model_parallel_size=2,
           num_virtual_stages_per_pipeline_rank=2)


@pytest.mark.parametrize("argv", [["--terapipe-slices", "16", "32", "16"],
                                  ["--terapipe-num-slices", "4"], []],
                         ids=["slices", "num_slices", "searched"])
def test_the_plan_runs_megatrons_chunks(argv):
    args = parse(["--pipeline-schedule", "terapipe", *argv], **VPP)
    validate_terapipe_args(args)
    plan, report = plan_and_report(args, 64, 2)
    assert plan.virtual_stages == 2
    assert report.iteration_time is not None and report.iteration_time > 0
    # validated: runs without deadlock (the microbatches it was planned for: a searched plan's
    # W places are planned for them)
    LoweredSchedule.of(build_schedule(plan, report.num_microbatches, 2, 2))


def test_the_search_names_the_virtual_stages():
    args = parse(["--pipeline-schedule", "terapipe"], **VPP)
    _, report = plan_and_report(args, 64, 2)
    assert "on 2 virtual stages per rank" in report.source


@pytest.mark.parametrize("microbatches", [1, 3, 5, 7])
def test_microbatch_counts_need_not_be_a_multiple_of_the_stages(microbatches):
    """Megatron's interleaved 1F1B groups microbatches by the pipeline size; token slices fill
    the ring with cells, so any count runs (validated lists, both orders)."""
    for order in ("1f1b", "gpipe"):
        args = parse(["--pipeline-schedule", "terapipe", "--terapipe-order", order,
                      "--terapipe-num-slices", "2"], **VPP)
        plan, _ = plan_and_report(args, 64, 2)
        LoweredSchedule.of(build_schedule(plan, microbatches, 2, 2))


def test_chunks_that_do_not_divide_a_stage_are_refused():
    args = parse(["--pipeline-schedule", "terapipe"], num_layers=6,
                 virtual_pipeline_model_parallel_size=2)
    with pytest.raises(TeraPipeArgumentError, match="do not divide the 3 layers"):
        validate_terapipe_args(args)


def test_auto_chooses_within_the_chunks_the_flags_fix():
    """Virtual-stage flags fix auto's layout: it is accepted, and every row of its table is on
    those chunks (tests/glue/args/test_auto_trials.py checks the trials' shortlist)."""
    from megatron_terapipe.megatron.args.auto_schedule import schedule_table

    run = validate_terapipe_args(parse(["--pipeline-schedule", "auto"], **VPP))
    chunks = run.support.virtual_stages
    table, _ = schedule_table(run)
    assert chunks > 1 and {o.num_chunks for o in table.options} == {chunks}


GROUP = "--microbatch-group-size-per-virtual-pipeline-stage"


def _grouped(argv, group, **megatron):
    """The flags with Megatron's microbatch group (its dest, as Megatron-LM parses it)."""
    return parse(["--pipeline-schedule", "terapipe", *argv], **VPP, **megatron,
                 microbatch_group_size_per_vp_stage=group)


@pytest.mark.parametrize("argv", [["--terapipe-num-slices", "2"], []], ids=["num_slices", "searched"])
def test_megatrons_group_flag_sets_the_plans_groups(argv):
    """4 microbatches on 2 stages in groups of 3: Megatron's interleaved 1F1B refuses it (the
    last group, 1 microbatch, is shorter than the pipeline); cut in 2 token slices the last
    group holds 2 units, which TeraPipe's order needs. The start-up report says so."""
    args = _grouped(argv, 3)
    validate_terapipe_args(args)
    plan, report = plan_and_report(args, 64, 2)
    assert report.num_microbatches == 4 and plan.virtual_group == 3
    assert len(plan.token_slices[0]) >= 2  # one slice would leave the last group 1 unit
    lines = report.lines(plan)
    assert ">   virtual stages ............ 2 model chunks per stage, microbatches in groups of 3" in lines
    assert f">   note: microbatch groups of 3 from {GROUP}" in lines
    LoweredSchedule.of(build_schedule(plan, 4, 2, 2))
    unset, _ = plan_and_report(parse(["--pipeline-schedule", "terapipe", *argv], **VPP), 64, 2)
    assert unset.virtual_group != 3  # without the flag the groups are the planner's


def test_a_group_no_slicing_allows_is_refused_naming_the_flag():
    with pytest.raises(TeraPipeArgumentError, match=f"{GROUP} 3: with 1 cell per microbatch "
                       r"\(token slices x batch slices\) that is 3 units per group and 1 in the "
                       r"last of 4 microbatches, but every group needs at least 2 \(one per "
                       r"pipeline stage\): give one of 2, 4,"):
        plan_and_report(_grouped(["--terapipe-num-slices", "1"], 3), 64, 2)
    with pytest.raises(TeraPipeArgumentError, match=f"{GROUP} 1: no slicing the search tries "
                       r"\(up to 1 slice\) gives every group of 1 of the 4 microbatches"):
        plan_and_report(_grouped(["--terapipe-granularity", "64"], 1), 64, 2)  # whole sequences
    with pytest.raises(TeraPipeArgumentError, match=f"{GROUP} must be a positive number"):
        validate_terapipe_args(_grouped([], 0))


def test_the_group_flag_is_said_not_to_apply_where_it_does_not():
    plan, report = plan_and_report(_grouped(["--terapipe-order", "gpipe"], 3), 64, 2)
    assert plan.virtual_group is None
    assert f">   note: {GROUP} 3 does not apply: the gpipe order runs every forward first" in report.lines(plan)
    args = parse(["--pipeline-schedule", "terapipe"], microbatch_group_size_per_vp_stage=3)
    plan, report = plan_and_report(args, 64, 2)
    assert f">   note: {GROUP} 3 does not apply: no virtual pipeline stages" in report.lines(plan)


def test_auto_chooses_the_groups_itself():
    args = parse(["--pipeline-schedule", "auto"], microbatch_group_size_per_vp_stage=2)
    with pytest.raises(TeraPipeArgumentError, match=f"drop {GROUP}"):
        validate_terapipe_args(args)
