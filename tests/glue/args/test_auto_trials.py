"""--pipeline-schedule auto that measures, from Megatron-LM's flags (args/auto_trials.py): the
shortlist within the predicted layout, the layout the flags fix accepted and kept, the
calibration fitted on the trials saved beside the profile cache and planned with at the next
start, and the message when auto builds the model in chunks. The trials themselves:
test_measured_choice.py; through Megatron-LM's pretrain_gpt.py: the slow matrix."""

from __future__ import annotations

import json

import pytest

from megatron_terapipe import TeraPipePlan
from megatron_terapipe.megatron.args.auto_schedule import predicted_choice
from megatron_terapipe.megatron.args.auto_trials import (SHORTLIST, calibration_path,
                                                         load_calibration, make_replan,
                                                         measured_choice)
from megatron_terapipe.megatron.args.checks import validate_terapipe_args
from megatron_terapipe.megatron.args.settings import RunSettings
from megatron_terapipe.megatron.hooks.measured_choice import MEGATRON
from megatron_terapipe.planner.evaluate.calibration import CalibratedCostModel
from harness.inputs.flags import AUTO, SHAPE, gpt3_13b_auto_args, parse


def choice_for(argv, **shape):
    lines: list[str] = []
    run = validate_terapipe_args(parse(AUTO + argv, **{**SHAPE, **shape}))
    predicted = predicted_choice(run, log=lines.append)
    choice, layout = measured_choice(run, predicted.inputs, predicted.table,
                                     predicted.choice.chosen, lines.append)
    return run, predicted, choice, layout, lines


def test_the_shortlist_holds_megatrons_schedule_and_terapipes_plans_that_fit():
    run, predicted, choice, layout, lines = choice_for(["--terapipe-memory-budget", "80GiB"])
    names = [c.name for c in choice.candidates]
    assert 2 <= len(names) <= SHORTLIST and len(set(names)) == len(names)
    first = choice.candidates[0]
    assert first.family == MEGATRON and first.plan is None
    assert first.name == ("Megatron 1F1B" if layout.chunks == 1
                          else f"Megatron interleaved, {layout.chunks} chunks")
    plans = [c.plan for c in choice.candidates[1:]]
    assert all(p is not None and p.virtual_stages == layout.chunks for p in plans)
    assert len(set(plans)) == len(plans)
    inputs = predicted.inputs
    for c in choice.candidates:
        assert c.predicted_s and c.schedule is not None, c.name
        if c.plan is not None:
            assert inputs.budget.fits(inputs.space.simulate(c.plan, inputs.cost_model)
                                      .peak_memory_bytes), c.name
    assert choice.predicted.name == predicted.choice.chosen.name
    timing = len(names) + 1  # the timing line, then each candidate's plan, exactly
    assert lines[-timing] == (f"> terapipe auto: timing {len(names)} schedules on "
                              f"{layout.chunks} model chunk{'s' * (layout.chunks > 1)} per "
                              "stage, 2 iterations each after a warm-up, in interleaved "
                              f"rounds: {'; '.join(names)}")
    for line, c in zip(lines[-len(names):], choice.candidates):
        name, text = line.removeprefix("terapipe auto plan: ").split(" = ")
        plan = None if text == '"megatron"' else TeraPipePlan.from_dict(json.loads(text))
        assert (name, plan) == (c.name, c.plan)


@pytest.mark.parametrize("microbatches,far", [(1, 9), (4, 3)])
def test_where_the_best_plan_cuts_no_sequence_a_far_uniform_slicing_is_tried(microbatches, far):
    """On 2 stages the far end leaves a tenth of the iteration to the bubble: M x K cells >= 9.
    Trials of one slice alone could not show whether slicing pays here."""
    shape = dict(num_layers=2, hidden_size=512, num_attention_heads=8, vocab_size=128,
                 global_batch_size=microbatches, bf16=False)
    _, predicted, choice, _, _ = choice_for([], **shape)
    best = next(c for c in choice.candidates if c.plan is not None)
    assert best.plan.seq_slices == (2048,)  # the analytic model cuts no sequence here
    assert predicted.inputs.search(best.plan.order).starts[1].plan.seq_slices == (2048,)
    uniform = [c for c in choice.candidates if "uniform" in c.name]
    assert [c.name for c in uniform] == [f"{best.name}, uniform {far} slices"]
    assert len(uniform[0].plan.seq_slices) == far and sum(uniform[0].plan.seq_slices) == 2048
    assert len(set(uniform[0].plan.seq_slices)) <= 2  # near-equal
    assert uniform[0].predicted_s == uniform[0].plan.predicted_time > 0


def test_auto_chooses_within_the_virtual_stages_the_flags_fix():
    run, predicted, choice, layout, _ = choice_for([], num_virtual_stages_per_pipeline_rank=2,
                                                   virtual_pipeline_model_parallel_size=2)
    assert run.support.virtual_stages == 2 and layout.chunks == 2
    assert {o.num_chunks for o in predicted.table.options} == {2}
    assert choice.candidates[0].name == "Megatron interleaved, 2 chunks"
    assert all(c.plan.virtual_stages == 2 for c in choice.candidates[1:])
    assert len(choice.candidates) >= 2


def test_the_calibration_is_saved_and_the_next_start_plans_with_it(tmp_path):
    argv = ["--terapipe-cache-dir", str(tmp_path)]
    run, predicted, choice, layout, _ = choice_for(argv)
    # measured: every candidate 1.5x its prediction plus 2 ms
    measured = [(c, 1.5 * c.predicted_s + 0.002) for c in choice.candidates]
    lines: list[str] = []
    extra = make_replan(run, predicted.inputs, layout.chunks, lines.append)(measured)
    assert lines[0].startswith("terapipe auto: calibrated cost model (x")
    assert "largest error on the trials" in lines[0]
    saved = load_calibration(calibration_path(run))
    assert saved is not None and saved.error_after < saved.error_before
    assert extra is None or extra.name.endswith(", calibrated")
    # the next start: its predictions on the calibrated model
    again = predicted_choice(RunSettings.from_args(parse(AUTO + argv, **SHAPE)),
                             log=lambda line: None)
    model = again.inputs.cost_model
    assert isinstance(model, CalibratedCostModel)
    assert (model.scale, model.per_cell_s) == (saved.scale, saved.per_cell_s)
    # a calibration fitted on that calibrated model is saved as one of the base model
    lines.clear()
    make_replan(run, again.inputs, layout.chunks, lines.append)(measured)
    twice = load_calibration(calibration_path(run))
    base = model.base
    for length in (256, 1024, 2048):
        nested = CalibratedCostModel(model, 0.0, 1.0)  # what the second fit was relative to
        direct = CalibratedCostModel(base, twice.per_cell_s, twice.scale)
        fitted = CalibratedCostModel(model, *_relative(twice, saved))
        assert fitted.forward_time(1, length, 0) == pytest.approx(
            direct.forward_time(1, length, 0), rel=1e-9)
        assert nested.forward_time(1, length, 0) == pytest.approx(
            model.forward_time(1, length, 0))


def _relative(total, first):
    """The calibration on top of `first` that makes `total`: s1 = S / s0, p1 = P - s1 p0."""
    s1 = total.scale / first.scale
    return total.per_cell_s - s1 * first.per_cell_s, s1


def test_auto_says_when_it_builds_the_model_in_chunks(monkeypatch, capsys):
    """gpt3-13b on 8 stages (test_auto_schedule_flags): auto's layout is 5 chunks per stage."""
    from megatron_terapipe.megatron.hooks import install, selection
    from megatron_terapipe.megatron.wiring import setup_from_args

    args = gpt3_13b_auto_args(monkeypatch)
    try:
        setup_from_args(args)
        assert args.virtual_pipeline_model_parallel_size == 5
        assert args.pipeline_schedule == "terapipe"
        out = capsys.readouterr().out
        assert ("> terapipe auto: the model is built in 5 chunks per stage (virtual pipeline "
                "stages), as Megatron's interleaved schedule builds it: from scratch, it starts "
                "from other initial weights than the same flags under --pipeline-schedule 1f1b; "
                "a checkpoint loads and resumes as usual") in out
        choice = selection.STATE.measured
        assert choice.candidates[0].name == "Megatron interleaved, 5 chunks"
    finally:
        selection.deselect()
        install.use_slice_attention_in_gpt_models(False)
