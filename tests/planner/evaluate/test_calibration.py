"""The cost model learns from the run (planner/evaluate/calibration.py), and the simulator's
host floor: fits on synthetic trials that the simulator itself measured under planted errors."""

from __future__ import annotations

import json

import pytest

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner import FunctionCostModel, simulate, solve
from megatron_terapipe.planner.evaluate.calibration import (CalibratedCostModel, Calibration,
                                                            Trial, fit_calibration)
from megatron_terapipe.planner.evaluate.simulator import CellCosts, HostFloor, schedule_time
from megatron_terapipe.schedule import build_interleaved_schedule, build_schedule

SEQ, STAGES = 2048, 4


def base_model() -> FunctionCostModel:
    """A stage's layers: a fixed cost, linear in tokens, and attention over the context."""
    return FunctionCostModel(
        forward=lambda b, l, c: 1e-4 + b * (2e-6 * l + 4e-9 * l * (c + l / 2)),
        transfer=lambda b, l: 5e-5 + 1e-8 * b * l, name="synthetic")


def schedules():
    """Six different shapes: slice counts, orders, microbatches, W modes, chunks."""
    plans = [(TeraPipePlan([SEQ]), 1), (TeraPipePlan.uniform(SEQ, 4), 1),
             (TeraPipePlan.uniform(SEQ, 8), 2), (TeraPipePlan([1024, 640, 384], order="gpipe"), 1),
             (TeraPipePlan([1024, 1024], defer_wgrad=False), 4),
             (TeraPipePlan([1024, 1024], virtual_stages=2), 4)]
    out = [(f"{len(p.seq_slices)} slices x {m}{' V2' * (p.virtual_stages > 1)}",
            build_schedule(p, m, STAGES, 1)) for p, m in plans]
    interleaved = ("interleaved x 4", build_interleaved_schedule(SEQ, 4, STAGES, 2, 1))
    return out[:5] + [interleaved] + out[5:]


def trials(truth, cores=None):
    """Every schedule 'measured' under the cost model `truth`, predicted on the base model."""
    base = base_model()
    return [Trial(s, base, schedule_time(s, truth, cores), name, cores) for name, s in schedules()]


@pytest.mark.parametrize("cores", [None, 2.5])
def test_the_fit_recovers_a_planted_per_cell_overhead_and_scale(cores):
    truth = CalibratedCostModel(base_model(), per_cell_s=2e-3, scale=1.3)
    calibration = fit_calibration(trials(truth, cores))
    assert calibration.per_cell_s == pytest.approx(2e-3, rel=0.05)
    assert calibration.scale == pytest.approx(1.3, rel=0.05)
    assert calibration.error_before > 0.3
    assert calibration.error_after < 0.01
    assert calibration.note == ""
    assert len(calibration.fitted_on) == len(calibration.trial_errors) == 7


def test_a_negative_overhead_is_recovered_too():
    """A graphed run pays less per cell than an eagerly timed profile says."""
    truth = CalibratedCostModel(base_model(), per_cell_s=-5e-5, scale=0.8)
    calibration = fit_calibration(trials(truth))
    assert calibration.per_cell_s == pytest.approx(-5e-5, rel=0.05)
    assert calibration.scale == pytest.approx(0.8, rel=0.05)


def test_with_nothing_planted_the_fit_is_the_identity():
    calibration = fit_calibration(trials(base_model()))
    assert abs(calibration.per_cell_s) < 1e-9
    assert calibration.scale == pytest.approx(1.0, abs=1e-9)
    assert calibration.error_before < 1e-12 and calibration.error_after < 1e-12


def test_one_trial_fits_the_scale_alone_and_says_so():
    truth = CalibratedCostModel(base_model(), scale=1.2)
    calibration = fit_calibration(trials(truth)[1:2])
    assert calibration.per_cell_s == 0.0
    assert calibration.scale == pytest.approx(1.2, rel=1e-6)
    assert "scale alone" in calibration.note


def test_the_replanned_dp_takes_fewer_slices_under_a_large_per_cell_overhead():
    base = base_model()
    plain = solve(base, SEQ, 1, 8, granularity=64)
    assert len(plain.seq_slices) >= 4  # slicing pays under the base model
    truth = CalibratedCostModel(base, per_cell_s=20e-3)
    calibration = fit_calibration(trials(truth))
    replanned = solve(calibration.apply(base), SEQ, 1, 8, granularity=64)
    assert len(replanned.seq_slices) < len(plain.seq_slices)
    # and it is the better plan where the overhead is real
    assert (schedule_time(build_schedule(replanned, 1, 8, 1), truth)
            < schedule_time(build_schedule(plain, 1, 8, 1), truth))


def test_a_chunks_cell_pays_the_per_cell_overhead_whole():
    """Virtual stages and Megatron's interleaved chunks: the layers' time is the chunk's share,
    the overhead per action is not."""
    base, o = base_model(), 3e-3
    for schedule in (build_schedule(TeraPipePlan([1024, 1024], virtual_stages=2), 4, STAGES, 1),
                     build_interleaved_schedule(SEQ, 4, STAGES, 2, 1)):
        plain = CellCosts(base, schedule)
        calibrated = CellCosts(CalibratedCostModel(base, o), schedule)
        actions = [a for a in schedule.stages[1] if a.kind in "FB"]
        assert actions
        for a in actions:
            assert calibrated.compute(1, a) == pytest.approx(plain.compute(1, a) + o)


def test_the_calibrated_model_keeps_transfers_memory_and_attributes():
    base = base_model()
    base.layers_per_stage = 3
    model = Calibration(per_cell_s=1e-3, scale=2.0).apply(base)
    assert model.transfer_time(1, 512) == base.transfer_time(1, 512)
    assert model.activation_bytes(1, 512, 0) == base.activation_bytes(1, 512, 0)
    assert model.forward_time(1, 512, 0) == pytest.approx(2 * base.forward_time(1, 512, 0) + 1e-3)
    assert model.layers_per_stage == 3
    assert "calibrated" in model.describe()
    # a negative overhead takes at most half a cell's scaled time (MIN_CELL_SHARE)
    assert CalibratedCostModel(base, per_cell_s=-1.0, scale=2.0).forward_time(1, 64, 0) == \
        pytest.approx(base.forward_time(1, 64, 0))


def test_a_calibration_round_trips_through_json():
    calibration = fit_calibration(trials(CalibratedCostModel(base_model(), 1e-3, 1.1))[:3])
    again = Calibration.from_dict(json.loads(json.dumps(calibration.to_dict())))
    assert again == calibration


def test_bad_trials_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        fit_calibration([])
    schedule = schedules()[0][1]
    with pytest.raises(ValueError, match="positive"):
        fit_calibration([Trial(schedule, base_model(), 0.0, "zero")])


# ---- the host floor -------------------------------------------------------------------------

def test_the_host_floor_is_off_unless_asked_and_a_low_one_changes_nothing():
    for _, schedule in schedules():
        base = schedule_time(schedule, base_model())
        assert schedule_time(schedule, base_model(), host_floor=HostFloor()) == base
        # below every F and B (the base model's W actions cost 0: any W floor would bind)
        assert schedule_time(schedule, base_model(), host_floor=HostFloor(1e-6, 1e-6)) == base


def test_an_eager_cell_costs_at_least_its_launches_host_time():
    floor = HostFloor(forward_s=0.05, backward_s=0.08)
    plan = TeraPipePlan.uniform(SEQ, 8, order="1f1b")
    result = simulate(build_schedule(plan, 2, STAGES, 1), base_model(), host_floor=floor)
    spans = {"F": [], "B": []}
    for ta in result.timeline:
        if ta.action.kind in spans:
            spans[ta.action.kind].append(ta.end - ta.start)
    assert spans["F"] and all(s == pytest.approx(0.05) for s in spans["F"])
    assert spans["B"] and all(s == pytest.approx(0.08) for s in spans["B"])
    without = simulate(build_schedule(plan, 2, STAGES, 1), base_model())
    assert result.iteration_time > without.iteration_time


def test_a_chunks_host_floor_is_its_share():
    floor = HostFloor(forward_s=0.2, backward_s=0.2)
    result = simulate(build_interleaved_schedule(SEQ, 4, STAGES, 2, 1), base_model(),
                      host_floor=floor)
    forwards = [ta.end - ta.start for ta in result.timeline if ta.action.kind == "F"]
    assert forwards and all(s == pytest.approx(0.1) for s in forwards)
