"""--terapipe-edge-slices FIRST SLICES LAST LAST_SLICES: edge slicing by hand from Megatron-LM's
flags. The plan it gives (whole sequences, the first and last microbatches cut into near-equal
slices in whole units of the granularity), the start-up report's lines, and the refusals that
name the flag and the fix: with another slice flag, the gpipe order, virtual pipeline stages,
bad counts, more edge microbatches than an iteration has, `--pipeline-schedule auto`, and
without `--pipeline-schedule terapipe`."""

from __future__ import annotations

import pytest

from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from harness.inputs.flags import parse, plan_and_report

EDGES = ["--pipeline-schedule", "terapipe", "--terapipe-edge-slices", "2", "3", "1", "2"]


def test_the_flag_gives_an_edge_sliced_plan_and_reports_it():
    validate_terapipe_args(parse(EDGES))
    plan, report = plan_and_report(parse(EDGES), 64, 2)
    assert plan.token_slices == ((64,),) and plan.order == "1f1b"
    assert plan.edge_slices == ((2, (24, 24, 16)), (1, (32, 32)))
    # 8 samples in microbatches of 2 on one data-parallel rank: 4 microbatches
    assert [plan.cells_of(m, 4) for m in range(4)] == [3, 3, 1, 2]
    lines = report.lines(plan)
    assert ">   first 2 microbatches ...... 24 24 16" in lines
    assert ">   last 1 microbatches ...... 32 32" in lines
    assert any(line.startswith(">   slices from ............... --terapipe-edge-slices 2 3 1 2")
               for line in lines)
    assert report.iteration_time is not None  # predicted, as other fixed slices are


@pytest.mark.parametrize("argv, megatron, text", [
    (["--terapipe-order", "gpipe"], {}, "use --terapipe-order 1f1b"),
    ([], dict(num_layers=8, virtual_pipeline_model_parallel_size=2), "one model chunk per rank"),
    (["--terapipe-num-slices", "2"], {}, "mutually exclusive"),
])
def test_what_it_cannot_run_names_the_flag(argv, megatron, text):
    args = parse(EDGES[:2] + argv, **megatron)
    args.terapipe_edge_slices = [2, 3, 1, 2]  # set as a script would, past the parser's group
    with pytest.raises(TeraPipeArgumentError) as info:
        validate_terapipe_args(args)
    assert "--terapipe-edge-slices" in str(info.value) and text in str(info.value)


@pytest.mark.parametrize("counts", [["-1", "2", "1", "2"], ["1", "0", "1", "2"]])
def test_bad_counts_are_refused(counts):
    with pytest.raises(TeraPipeArgumentError, match="takes microbatch counts of 0 or more"):
        validate_terapipe_args(parse(EDGES[:3] + counts))


def test_auto_and_other_schedules_refuse_it():
    with pytest.raises(TeraPipeArgumentError, match="auto plans the token slices itself"):
        validate_terapipe_args(parse(["--pipeline-schedule", "auto", *EDGES[2:]]))
    with pytest.raises(TeraPipeArgumentError, match="--terapipe-edge-slices needs "
                                                    "--pipeline-schedule terapipe or auto"):
        validate_terapipe_args(parse(EDGES[2:]))


def test_the_parser_keeps_it_apart_from_the_other_slice_flags(capsys):
    with pytest.raises(SystemExit):
        parse([*EDGES, "--terapipe-slices", "32", "32"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("edges, microbatches", [(["9", "4", "1", "2"], "(9 + 1)"),
                                                 (["4", "2", "1", "2"], "(4 + 1)")])
def test_more_edge_microbatches_than_the_iteration_has_are_refused(edges, microbatches):
    # 8 samples in microbatches of 2 on one data-parallel rank: 4 microbatches
    args = parse(EDGES[:3] + edges)
    for check in (validate_terapipe_args, lambda a: plan_and_report(a, 64, 2)):
        with pytest.raises(TeraPipeArgumentError) as info:
            check(args)
        message = str(info.value)
        assert message.startswith(f"--terapipe-edge-slices {' '.join(edges)}: ")
        assert f"{microbatches} exceed the 4 microbatches" in message
        assert "--global-batch-size 8" in message and "at most 4" in message


def test_edge_microbatches_may_take_the_whole_iteration():
    args = parse(EDGES[:3] + ["3", "2", "1", "2"])
    validate_terapipe_args(args)
    plan, _ = plan_and_report(args, 64, 2)
    assert [plan.cells_of(m, 4) for m in range(4)] == [2, 2, 2, 2]
