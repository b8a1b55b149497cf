"""Measured weight-gradient (W) times in profiles: the fit, the cost model, the simulator, files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_terapipe.planner import LayerTimeFit, ProfiledCostModel, fit_layer_times, simulate
from megatron_terapipe.planner.profile.time_fit import FORMAT_VERSION
from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.schedule import build_schedule
from harness.inputs.cost_models import LINK, MODEL, synthetic


def true_wgrad(b, l):
    """A W action's seconds for one layer: fixed cost plus GEMMs linear in the tokens."""
    return 3e-5 + 7e-7 * b * l


def with_wgrad(batches=(1, 2, 4), measured_batches=None, saved_share=1.0):
    """Synthetic measurements whose deferred backward saves `saved_share` of the W time."""
    m = synthetic(batches=batches)
    measured = np.isin(m.batch, measured_batches or batches) & (m.context == 0)
    m.wgrad = np.where(measured, true_wgrad(m.batch, m.length), np.nan)
    m.deferred_backward = np.where(measured, m.backward - saved_share * m.wgrad, np.nan)
    return m


def test_measured_wgrad_is_what_the_cost_model_charges():
    fit = fit_layer_times(with_wgrad())
    assert fit.has_wgrad
    cost = ProfiledCostModel(fit, layers_per_stage=3, link=LINK)
    lengths = np.unique(fit.measurements.length)
    for b in (1, 2, 4):
        for c in (0, 16, 512):  # the weight gradients never see the context
            assert cost.layer_wgrad_time(b, lengths, c) == pytest.approx(true_wgrad(b, lengths))
    # between measured lengths: the table interpolates (exact here, W is linear in the tokens)
    assert cost.layer_wgrad_time(2, 100, 0) == pytest.approx(true_wgrad(2, 100))
    # a stage of 3 layers, first stage (the embedding has no linear weight gradients here)
    assert cost.wgrad_time(1, 256, 64, True, False) == pytest.approx(3 * true_wgrad(1, 256))
    # differs from the estimate it replaces
    estimate = ProfiledCostModel(fit_layer_times(synthetic()), layers_per_stage=3, link=LINK)
    assert not np.isclose(estimate.layer_wgrad_time(1, 256, 0), true_wgrad(1, 256), rtol=0.05)


def test_simulator_prices_each_w_from_the_measured_table():
    cost = ProfiledCostModel(fit_layer_times(with_wgrad()), layers_per_stage=2, link=LINK)
    plan = TeraPipePlan([256, 128, 128], defer_wgrad=True, wgrad_points=[[2]])
    result = simulate(build_schedule(plan, 1, 2, 1), cost)
    w = {a.action.cell.token_slice: a.end - a.start
         for a in result.timeline if a.stage == 0 and a.action.kind == "W"}
    # the early W after slice 2 covers 128 tokens; the last one slices 1 and 0 (384 tokens),
    # each as one GEMM over its tokens
    assert w[2] == pytest.approx(2 * true_wgrad(1, 128))
    assert w[0] == pytest.approx(2 * true_wgrad(1, 384))
    # a deferred backward cell is the full backward less its slice's weight gradients
    b = {a.action.cell.token_slice: a.end - a.start
         for a in result.timeline if a.stage == 0 and a.action.kind == "B"}
    full = cost.backward_time(1, 256, 0)
    assert b[0] == pytest.approx(full - 2 * true_wgrad(1, 256))


def test_round_trip_keeps_the_measured_wgrad(tmp_path):
    fit = fit_layer_times(with_wgrad())
    path = fit.save(tmp_path / "profile.json")
    data = json.loads(path.read_text())
    assert data["format_version"] == FORMAT_VERSION == 3
    assert set(data["fit"]) == {"forward", "backward", "wgrad", "wgrad_saving"}
    stored = data["measurements"]["wgrad"]
    contexts = data["measurements"]["context"]
    assert all((w is None) == (c > 0) for w, c in zip(stored, contexts))  # JSON null, not NaN
    loaded = LayerTimeFit.load(path, model=MODEL, tensor_parallel=1)
    assert loaded.has_wgrad
    l = np.array([16, 48, 300, 1024])
    assert loaded.seconds("wgrad", 2, l, 0) == pytest.approx(fit.seconds("wgrad", 2, l, 0))
    assert np.isnan(loaded.measurements.wgrad).sum() == np.isnan(fit.measurements.wgrad).sum()


def test_profiles_without_wgrad_use_the_estimate(tmp_path):
    data = fit_layer_times(with_wgrad()).to_dict()
    data["format_version"] = 2  # what version 2 wrote: no wgrad fit or columns
    del data["fit"]["wgrad"], data["fit"]["wgrad_saving"]
    del data["measurements"]["wgrad"], data["measurements"]["deferred_backward"]
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(data))
    old = ProfiledCostModel(LayerTimeFit.load(path), layers_per_stage=2, link=LINK)
    assert not old.fit.has_wgrad
    plain = ProfiledCostModel(fit_layer_times(synthetic()), layers_per_stage=2, link=LINK)
    l, c = np.array([64, 256]), np.array([0, 128])
    assert old.layer_wgrad_time(1, l, c) == pytest.approx(plain.layer_wgrad_time(1, l, c))
    assert plain.layer_wgrad_time(1, 256, 0) > 0
    # a wgrad fit in a version-2 file is not read
    data["fit"]["wgrad"] = fit_layer_times(with_wgrad()).to_dict()["fit"]["wgrad"]
    path.write_text(json.dumps(data))
    assert not LayerTimeFit.load(path).has_wgrad


def test_partial_or_bad_wgrad_measurements():
    # not measured at every batch size: no table (the estimate stays in use)
    assert not fit_layer_times(with_wgrad(measured_batches=(1, 2))).has_wgrad
    bad = with_wgrad()
    bad.wgrad[np.flatnonzero(np.isfinite(bad.wgrad))[0]] = -1.0
    with pytest.raises(ValueError, match="negative weight-gradient times"):
        fit_layer_times(bad)


def test_deferred_backward_saves_what_was_measured_not_the_w_time():
    # a short slice's W costs more as its own action than inside the backward: here deferring
    # saves the backward only 60% of what the W action then costs
    cost = ProfiledCostModel(fit_layer_times(with_wgrad(saved_share=0.6)), layers_per_stage=2,
                             link=LINK)
    assert cost.layer_deferred_backward_saving(1, 256, 64) == pytest.approx(0.6 * true_wgrad(1, 256))
    plan = TeraPipePlan([256, 256], defer_wgrad=True)
    result = simulate(build_schedule(plan, 1, 2, 1), cost)
    spans = {(a.action.kind, a.action.cell.token_slice): a.end - a.start
             for a in result.timeline if a.stage == 0}
    assert spans[("B", 0)] == pytest.approx(cost.backward_time(1, 256, 0) - 2 * 0.6 * true_wgrad(1, 256))
    assert spans[("B", 1)] == pytest.approx(cost.backward_time(1, 256, 256) - 2 * 0.6 * true_wgrad(1, 256))
    assert spans[("W", 0)] == pytest.approx(2 * true_wgrad(1, 512))  # one GEMM over both slices
