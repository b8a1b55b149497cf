"""Scatter-gather messages between stages (--terapipe-scatter-gather-p2p, terapipe-plan's
--scatter-gather-p2p): how the planner prices them (each TP rank sends 1/TP over the pipeline
link, the receivers all-gather it inside the node; Megatron's own schedules keep whole
messages), and the flags that ask for them. Every gradient with them equal to Megatron's own
run, and the halved bytes over the link: test_equivalence.py and test_virtual_runs.py."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from megatron_terapipe.megatron.args.inputs_from_flags import planner_inputs
from megatron_terapipe.megatron.args.settings import RunSettings
from megatron_terapipe.planner.cli.command import build_parser, main
from megatron_terapipe.planner.cli.arguments import inputs_from_options
from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner.evaluate.list_estimate import estimate_lists
from megatron_terapipe.planner.evaluate.simulator import schedule_time, simulate, simulate_plan
from megatron_terapipe.schedule import build_schedule
from harness.inputs.cost_models import GPT13, H100, gpt3_13b_h100
from harness.inputs.flags import parse, plan_and_report

QUESTION = ("--model gpt3-13b --hardware h100 --pipeline-stages 8 --tensor-parallel-size 8 "
            "--seq-length 8192 --micro-batch-size 1 --num-microbatches 8 "
            "--virtual-stages 1").split()


def test_a_message_crosses_the_link_in_tp_parts_and_is_gathered_in_the_node():
    b, l = np.array([1.0, 2.0]), np.array([1024.0, 8192.0])
    whole = gpt3_13b_h100(8)
    parts = whole.with_scatter_gather(H100.intra_node)
    part_bytes = b * l * GPT13.hidden_size * 2 / 8
    assert np.allclose(parts.transfer_time(b, l), H100.inter_node.time(part_bytes), rtol=1e-12)
    # the gather is the receiving stage's own time, a ring of 7 steps of a part over NVLink
    assert np.allclose(parts.receive_time(b, l), 7 * H100.intra_node.time(part_bytes),
                       rtol=1e-12)
    assert np.array_equal(whole.receive_time(b, l), np.zeros(2))
    assert parts.without_scatter_gather().transfer_time(8, 1024) == whole.transfer_time(8, 1024)
    assert parts.without_scatter_gather().receive_time(8, 1024) == 0
    assert "scatter-gather messages" in parts.describe()
    assert "scatter-gather" not in whole.describe()
    # nothing to split at TP 1; sequence parallelism splits the messages already
    for plain in (gpt3_13b_h100(1), gpt3_13b_h100(8, sp=True)):
        same = plain.with_scatter_gather(H100.intra_node)
        assert np.array_equal(same.transfer_time(b, l), plain.transfer_time(b, l))
        assert np.array_equal(same.receive_time(b, l), np.zeros(2))
        assert same.describe() == plain.describe()
    # compute and memory are the same model's
    assert np.array_equal(parts.forward_time(b, l, 0), whole.forward_time(b, l, 0))
    assert np.array_equal(parts.activation_bytes(b, l, 0), whole.activation_bytes(b, l, 0))


@pytest.mark.parametrize("V", [1, 5])
def test_each_received_message_costs_its_stage_the_gather(V):
    """A cell that takes a message (an input, but on the model's first virtual stage; a
    gradient, but on its last) costs its stage receive_time more: 4 stages, 3 microbatches,
    2 slices, on one chunk per stage and on 5."""
    whole = gpt3_13b_h100(8)
    parts = whole.with_scatter_gather(H100.intra_node)
    plan = TeraPipePlan([4096, 4096], virtual_stages=V)
    K, M, cells = 4, 3, 3 * 2
    plain, split = (simulate_plan(plan, cost, M, K, 1) for cost in (whole, parts))
    gather = float(parts.receive_time(1, 4096))
    for k in range(K):
        received = cells * (2 * V - (k == 0) - (k == K - 1))
        assert split.busy[k] == pytest.approx(plain.busy[k] + received * gather, rel=1e-9)
    schedule = build_schedule(plan, M, K, 1)
    assert estimate_lists(schedule, parts).busiest_compute == pytest.approx(max(split.busy),
                                                                            rel=1e-9)
    # messages in parts: over the link in an eighth of the whole message's time and more
    assert float(parts.transfer_time(1, 4096)) < float(whole.transfer_time(1, 4096)) / 4
    # what the Megatron rows are priced with: whole messages, no gather
    megatron = simulate(schedule, parts.without_scatter_gather())
    assert megatron.busy == simulate(schedule, whole).busy


def _table(extra: list[str]):
    parser = build_parser()
    return inputs_from_options(parser.parse_args(QUESTION + extra), parser).schedule_table()


def test_megatron_rows_keep_whole_messages_and_terapipe_rows_are_priced_in_parts():
    """Whether parts pay depends on the links (a part crosses the slow link, its gather sits
    on the stage's time); what holds: Megatron's rows are timed with whole messages, TeraPipe's
    with parts and the gather."""
    parser = build_parser()
    inputs = inputs_from_options(parser.parse_args(QUESTION + ["--scatter-gather-p2p"]), parser)
    whole, parts = _table([]), inputs.schedule_table()
    times = {o.name: o.time for o in whole.options}
    for option in parts.options:
        if option.name.startswith("Megatron"):
            assert option.time == times[option.name], option.name
    rows = [o for o in parts.options if o.name.startswith("TeraPipe") and o.runnable]
    assert rows
    for option in rows:
        schedule = build_schedule(option.plan, 8, 8, 1)
        in_parts = schedule_time(schedule, inputs.cost_model)
        assert in_parts == pytest.approx(option.time, rel=1e-9), option.name
        assert schedule_time(schedule, inputs.cost_model.without_scatter_gather()) != \
            pytest.approx(in_parts, rel=1e-6)


def test_planner_cli_refuses_it_with_sequence_parallel(capsys):
    with pytest.raises(SystemExit):
        main(QUESTION + ["--scatter-gather-p2p", "--sequence-parallel"])
    err = capsys.readouterr().err
    assert "--scatter-gather-p2p" in err and "--sequence-parallel does already" in err


TERAPIPE = ["--pipeline-schedule", "terapipe"]


def test_megatron_lm_flag_reaches_the_cost_model_and_the_run():
    args = parse(TERAPIPE + ["--terapipe-scatter-gather-p2p"], tensor_model_parallel_size=2,
                 pipeline_model_parallel_size=2, world_size=4)
    run = validate_terapipe_args(args)
    assert run.terapipe.scatter_gather
    inputs = planner_inputs(RunSettings.from_args(args).for_batch(64, 2))
    assert inputs.cost_model.gather_link is not None
    assert "scatter-gather messages" in inputs.cost_model.describe()
    # the report's baseline is Megatron's 1F1B as it runs, with whole messages
    _, report = plan_and_report(args, 64, 2)
    _, plain_report = plan_and_report(parse(
        TERAPIPE, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, world_size=4),
        64, 2)
    assert "scatter-gather messages" in report.cost_model
    assert report.baseline_time == plain_report.baseline_time
    plain = planner_inputs(RunSettings.from_args(parse(
        TERAPIPE, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
        world_size=4)).for_batch(64, 2))
    assert plain.cost_model.gather_link is None


def test_megatron_lm_flag_is_refused_with_sequence_parallel():
    args = parse(TERAPIPE + ["--terapipe-scatter-gather-p2p"], tensor_model_parallel_size=2,
                 pipeline_model_parallel_size=2, world_size=4, sequence_parallel=True)
    with pytest.raises(TeraPipeArgumentError) as info:
        validate_terapipe_args(args)
    message = str(info.value)
    assert "--terapipe-scatter-gather-p2p" in message and "--sequence-parallel" in message
    assert "drop --terapipe-scatter-gather-p2p" in message


def test_megatron_lm_flag_only_means_something_with_terapipe():
    args = parse(["--terapipe-scatter-gather-p2p"])
    assert "--terapipe-scatter-gather-p2p" in RunSettings.from_args(args).terapipe.given_flags()


def test_setup_from_args_selects_scatter_gather_and_says_so(capsys):
    from megatron_terapipe.megatron.hooks import install, selection
    from megatron_terapipe.megatron.wiring import setup_from_args

    try:
        setup_from_args(parse(TERAPIPE + ["--terapipe-num-slices", "2",
                                          "--terapipe-scatter-gather-p2p"],
                              tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                              world_size=4))
        assert selection.STATE.default.scatter_gather is True
        assert ("> terapipe: stage-to-stage messages in 2 TP parts, all-gathered by the "
                "receiving stage (--terapipe-scatter-gather-p2p)") in capsys.readouterr().out
        setup_from_args(parse(TERAPIPE + ["--terapipe-num-slices", "2"]))
        assert not selection.STATE.default.scatter_gather
        assert "TP parts" not in capsys.readouterr().out
    finally:
        selection.deselect()
        install.use_slice_attention_in_gpt_models(False)
