"""What bench_auto.py judges on (no processes started): a candidate's paired time is its
median ratio to Megatron's schedule in the same round, or to the first candidate where
Megatron's schedule does not run, and the plain run is Megatron's wherever it runs."""

from __future__ import annotations

import argparse

import pytest

import bench_auto as bench


def test_pairs_cancel_load_that_drifts_between_rounds():
    # Round 2 ran on a machine twice as loaded: every candidate's time doubled there.
    times = {"megatron": [1.0, 2.0, 1.0], "a": [0.8, 1.6, 0.8], "b": [0.9, 1.8, 0.9]}
    paired = bench.paired_medians(times)
    assert paired == pytest.approx({"megatron": 1.0, "a": 0.8, "b": 0.9})


def test_pairs_to_the_first_candidate_without_megatrons_schedule():
    times = {"a": [1.0, 3.0, 1.0], "b": [0.5, 1.5, 0.5]}
    assert bench.paired_medians(times) == pytest.approx({"a": 1.0, "b": 0.5})


def test_spread_is_the_quartile_range_over_the_median():
    # statistics.quantiles' default (exclusive) quartiles of 1..5 are 1.5 and 4.5.
    assert bench.quartile_spread([3.0, 1.0, 5.0, 2.0, 4.0]) == pytest.approx(1.0)


def test_paired_spread_leaves_out_load_shared_by_the_round():
    # Every candidate doubled in round 2: the raw times spread, the ratios do not.
    times = {"megatron": [1.0, 2.0, 1.0, 1.0], "a": [0.8, 1.6, 0.8, 0.88]}
    ratios = bench.round_ratios(times)
    assert ratios["a"] == pytest.approx([0.8, 0.8, 0.8, 0.88])
    assert bench.quartile_spread(times["a"]) > 0.5
    assert bench.quartile_spread(ratios["a"]) == pytest.approx(0.06 / 0.8)


def test_the_paired_spread_summary_leaves_out_the_reference():
    # Without Megatron's schedule the pairs are to the first candidate, whose ratios are all 1.
    alone = [{"plan": "a", "rounds_s": [1.0], "spread": 0.2, "paired_spread": 0.0},
             {"plan": "b", "rounds_s": [1.0], "spread": 0.1, "paired_spread": 0.3}]
    assert bench.spread_summary(alone) == pytest.approx({"median": 0.15, "paired_median": 0.3})


@pytest.mark.parametrize("chunks, microbatches, schedule", [
    (1, 1, "1f1b"), (2, 4, "1f1b"), (2, 1, "terapipe")])
def test_the_plain_run_is_megatrons_wherever_it_runs(chunks, microbatches, schedule):
    flags = bench.plain_schedule(argparse.Namespace(chunks=chunks), microbatches)
    assert flags[flags.index("--pipeline-schedule") + 1] == schedule


def test_a_candidate_alone_is_the_only_one_auto_times(monkeypatch):
    """auto_alone.py's stand-in shortlist takes what measured_choice passes the real one."""
    import auto_alone
    from harness.inputs.flags import AUTO, SHAPE, parse
    from megatron_terapipe.megatron import launch
    from megatron_terapipe.megatron.args import auto_trials
    from megatron_terapipe.megatron.args.auto_schedule import predicted_choice
    from megatron_terapipe.megatron.args.checks import validate_terapipe_args

    monkeypatch.setattr(auto_trials, "shortlist", auto_trials.shortlist)  # restored after
    monkeypatch.setattr(auto_trials, "make_replan", auto_trials.make_replan)

    def main(rest):  # what the launcher would reach: auto's choice for these flags
        run = validate_terapipe_args(parse(AUTO, **SHAPE))
        predicted = predicted_choice(run, log=lambda line: None)
        choice, _ = auto_trials.measured_choice(run, predicted.inputs, predicted.table,
                                                predicted.choice.chosen, lambda line: None)
        return [c.name for c in choice.candidates], choice.replan

    monkeypatch.setattr(launch, "main", main)
    plan = '{"seq_slices": [1024, 1024], "order": "1f1b"}'
    names, replan = auto_alone.main(["TeraPipe 1f1b, uniform 2 slices", plan, "pretrain_gpt.py"])
    assert names == ["TeraPipe 1f1b, uniform 2 slices"] and replan is None
