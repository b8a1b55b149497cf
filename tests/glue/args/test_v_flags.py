"""--terapipe-virtual-placement v under --pipeline-schedule terapipe: the plan from the flags
puts Megatron's 2 model chunks per stage in a V (searched or fixed), and what a V cannot run
yet is refused at start-up, naming the flag and the fix."""

from __future__ import annotations

import pytest

from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from megatron_terapipe.schedule import LoweredSchedule, build_schedule
from harness.inputs.flags import parse, plan_and_report

#: 8 layers on 2 pipeline stages in 2 chunks of 2, untied embeddings (Megatron-LM's args)
V = dict(num_layers=8, virtual_pipeline_model_parallel_size=2,
         num_virtual_stages_per_pipeline_rank=2, untie_embeddings_and_output_weights=True)
FLAGS = ["--pipeline-schedule", "terapipe", "--terapipe-virtual-placement", "v"]


@pytest.mark.parametrize("argv", [["--terapipe-slices", "16", "32", "16"],
                                  ["--terapipe-num-slices", "4"], []],
                         ids=["slices", "num_slices", "searched"])
def test_the_plan_puts_the_chunks_in_a_v(argv):
    args = parse([*FLAGS, *argv], **V)
    validate_terapipe_args(args)
    plan, report = plan_and_report(args, 64, 2)
    assert plan.virtual_stages == 2 and plan.virtual_placement == "v"
    assert report.iteration_time is not None and report.iteration_time > 0
    LoweredSchedule.of(build_schedule(plan, report.num_microbatches, 2, 2))


def test_the_search_names_the_v():
    _, report = plan_and_report(parse(FLAGS, **V), 64, 2)
    assert "on 2 virtual stages per rank in a V" in report.source


def test_the_ring_stays_the_default():
    plan, _ = plan_and_report(parse(["--pipeline-schedule", "terapipe"], **V), 64, 2)
    assert plan.virtual_placement == "ring"


@pytest.mark.parametrize("argv, megatron, says", [
    (["--pipeline-schedule", "1f1b", "--terapipe-virtual-placement", "v"], V,
     "--terapipe-virtual-placement v needs --pipeline-schedule terapipe or auto"),
    (FLAGS, dict(V, num_virtual_stages_per_pipeline_rank=None,
                 virtual_pipeline_model_parallel_size=None),
     "give --num-virtual-stages-per-pipeline-rank 2"),
    (FLAGS, dict(V, num_layers=12, virtual_pipeline_model_parallel_size=3,
                 num_virtual_stages_per_pipeline_rank=3), "(here 3 chunks, 2 ranks)"),
    (FLAGS, dict(V, untie_embeddings_and_output_weights=False),
     "add --untie-embeddings-and-output-weights"),
    (FLAGS, dict(V, mtp_num_layers=1), "--mtp-num-layers yet"),
    (FLAGS, dict(V, mtp_num_layers=2), "--mtp-num-layers yet"),
    (FLAGS, dict(V, save="/tmp/ckpt", ckpt_format="torch"), "use --ckpt-format torch_dist"),
])
def test_what_a_v_cannot_run_is_refused_naming_the_flag(argv, megatron, says):
    with pytest.raises(TeraPipeArgumentError) as info:
        validate_terapipe_args(parse(argv, **megatron))
    assert says in str(info.value)


def test_auto_chooses_among_v_plans_when_the_flags_fix_a_v():
    """--pipeline-schedule auto with the V fixed by the flags: TeraPipe's V rows only (Megatron
    has no V), and a shortlist of V plans to time."""
    from megatron_terapipe.megatron.args.auto_schedule import predicted_choice
    from megatron_terapipe.megatron.args.auto_trials import shortlist
    from megatron_terapipe.megatron.args.settings import RunSettings

    args = parse(["--pipeline-schedule", "auto", "--terapipe-virtual-placement", "v"], **V)
    run = validate_terapipe_args(args)
    predicted = predicted_choice(RunSettings.from_args(args), log=lambda line: None)
    assert predicted.table.options and all(
        o.placement == "v" and o.num_chunks == 2 for o in predicted.table.options)
    candidates = shortlist(predicted.inputs, predicted.table, 2, "v")
    assert candidates and all(c.plan is not None and c.plan.virtual_placement == "v"
                              for c in candidates)
    assert run.terapipe.virtual_placement == "v"


#: A shape where the analytic A100 model predicts TeraPipe in a V fastest of all layouts: 16
#: untied layers on 4 stages, 8 sequences of 8192 tokens.
V_WINS = dict(num_layers=16, hidden_size=1024, num_attention_heads=16, seq_length=8192,
              micro_batch_size=1, global_batch_size=8, vocab_size=50304,
              pipeline_model_parallel_size=4, world_size=4,
              untie_embeddings_and_output_weights=True)
AUTO_A100 = ["--pipeline-schedule", "auto", "--terapipe-hardware", "a100"]


def _offered(argv, **megatron):
    from megatron_terapipe.megatron.args.auto_schedule import offers_v, predicted_choice
    from megatron_terapipe.megatron.args.settings import RunSettings

    args = parse([*AUTO_A100, *argv], **{**V_WINS, **megatron})
    run = RunSettings.from_args(args)
    offer = offers_v(run, args)
    table = predicted_choice(run, log=lambda line: None, offer_v=offer).table
    return offer, [o for o in table.options if o.placement == "v"]


def test_auto_offers_the_v_as_a_layout_where_the_flags_allow_one():
    offer, rows = _offered(["--terapipe-auto-trials", "0"])
    assert offer and {o.name for o in rows} == {"TeraPipe 1f1b, 2 chunks in a V",
                                               "TeraPipe gpipe, 2 chunks in a V"}


@pytest.mark.parametrize("argv, megatron", [
    ([], dict(untie_embeddings_and_output_weights=False)),
    ([], dict(mtp_num_layers=1)),
    (["--terapipe-virtual-placement", "ring"], {}),
    ([], dict(num_virtual_stages_per_pipeline_rank=2, virtual_pipeline_model_parallel_size=2)),
], ids=["tied", "mtp", "ring_given", "chunks_fixed"])
def test_auto_offers_no_v_where_the_flags_rule_it_out(argv, megatron):
    offer, rows = _offered(["--terapipe-auto-trials", "0", *argv], **megatron)
    assert not offer and not rows


@pytest.mark.parametrize("trials", ["0", "2"])
def test_auto_builds_the_model_in_a_v_when_it_picks_one(capsys, trials):
    """The predicted pick is the V: auto writes --terapipe-virtual-placement v and 2 chunks into
    Megatron-LM's args, says so, and (measuring) times V plans only, Megatron having no V."""
    from megatron_terapipe.megatron.hooks import install, selection
    from megatron_terapipe.megatron.model import v_layout
    from megatron_terapipe.megatron.wiring import setup_from_args

    args = parse([*AUTO_A100, "--terapipe-auto-trials", trials], **V_WINS)
    try:
        setup_from_args(args)
        assert args.terapipe_virtual_placement == "v" and args.pipeline_schedule == "terapipe"
        assert args.virtual_pipeline_model_parallel_size == 2
        assert v_layout.v_layout_on()
        out = capsys.readouterr().out
        assert "running TeraPipe 1f1b, 2 chunks in a V" in out
        if trials == "2":
            assert ("> terapipe auto: the model is built in 2 chunks per stage (virtual pipeline "
                    "stages) in a V (--terapipe-virtual-placement v): from scratch") in out
            candidates = selection.STATE.measured.candidates
            assert candidates and all(c.plan is not None and c.plan.virtual_placement == "v"
                                      for c in candidates)
    finally:
        v_layout.use_v_layout(False)
        selection.deselect()
        install.use_slice_attention_in_gpt_models(False)


def test_auto_offers_a_v_of_unequal_chunks_where_a_stage_s_layers_are_odd():
    """12 layers on 4 stages: 3 a stage, which the ring cannot halve; the V's rows hold chunks
    of 2 (down) and 1 (back), as the V builds them."""
    offer, rows = _offered(["--terapipe-auto-trials", "0"], num_layers=12)
    assert offer and len(rows) == 2 and all(o.plan.chunk_layers == (2, 1) for o in rows), rows
