"""Megatron-LM's virtual pipeline flags under --pipeline-schedule terapipe: the plan from the
flags runs as many model chunks per stage as Megatron builds (validate_args turns
--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank into
virtual_pipeline_model_parallel_size), searched or fixed, and what cannot run is refused at
start-up with the flag named."""

from __future__ import annotations

import pytest

from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from megatron_terapipe.schedule import LoweredSchedule, build_schedule
from test_arguments import parse, plan_and_report

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


def test_auto_chooses_the_chunks_itself():
    args = parse(["--pipeline-schedule", "auto"], **VPP)
    with pytest.raises(TeraPipeArgumentError, match="--num-virtual-stages-per-pipeline-rank"):
        validate_terapipe_args(args)
