"""ProfiledCostModel: fitting (numpy only), held-out error, save/load and its errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_terapipe.planner import (
    LayerTimeFit,
    ModelDims,
    ProfiledCostModel,
    fit_layer_times,
    solve_slicing,
)
from megatron_terapipe.planner.profile.time_fit import FORMAT_VERSION
from harness.inputs.cost_models import LINK, MODEL, paper_form, synthetic


def test_recovers_the_papers_form_exactly():
    fit = fit_layer_times(synthetic())
    rng = np.random.default_rng(1)
    b = rng.choice([1, 2, 4], 200)
    l = rng.integers(1, 64, 200) * 16
    c = rng.integers(0, 48, 200) * 16
    assert fit.seconds("forward", b, l, c) == pytest.approx(paper_form(b, l, c), rel=0.03)
    assert fit.holdout_error["forward"]["max_relative"] < 0.03
    assert fit.holdout_error["cells"] > 0


def test_noisy_measurements_report_honest_holdout_error():
    clean = fit_layer_times(synthetic())
    noisy = fit_layer_times(synthetic(noise=0.05))
    assert noisy.holdout_error["forward"]["mean_relative"] > clean.holdout_error["forward"]["mean_relative"]
    assert noisy.holdout_error["forward"]["mean_relative"] < 0.15


def test_batch_interpolation_and_extrapolation():
    fit = fit_layer_times(synthetic(batches=(1, 4)))
    t1, t4 = fit.seconds("forward", 1, 256, 128), fit.seconds("forward", 4, 256, 128)
    assert fit.seconds("forward", 2, 256, 128) == pytest.approx(t1 + (t4 - t1) / 3)
    assert fit.seconds("forward", 8, 256, 128) == pytest.approx(2 * t4)  # grows with the rows


def test_save_load_round_trip(tmp_path):
    fit = fit_layer_times(synthetic(noise=0.01))
    path = fit.save(tmp_path / "profile.json")
    loaded = LayerTimeFit.load(path, model=MODEL, tensor_parallel=1)
    b, l, c = np.array([1, 3, 4]), np.array([16, 200, 1000]), np.array([0, 64, 16])
    for d in ("forward", "backward"):
        assert loaded.seconds(d, b, l, c) == pytest.approx(fit.seconds(d, b, l, c))
    assert loaded.metadata["device"] == "synthetic"
    assert loaded.holdout_error == fit.holdout_error  # JSON keeps floats exactly
    assert json.loads(path.read_text())["format_version"] == FORMAT_VERSION
    cost = ProfiledCostModel.load(path, layers_per_stage=2, link=LINK, model=MODEL)
    assert cost.forward_time(2, 64, 64) == pytest.approx(2 * fit.seconds("forward", 2, 64, 64))
    assert cost.kv_bytes(1, 10) == pytest.approx(2 * 2 * 10 * 256 * 2)
    solution = solve_slicing(cost, 1024, 4, 4, granularity=64)
    assert solution.plan.seq_length == 1024


def test_mismatched_model_or_tp_is_refused(tmp_path):
    path = fit_layer_times(synthetic()).save(tmp_path / "p.json")
    other = ModelDims(num_layers=4, hidden_size=512, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"p\.json.*hidden_size 256 in the profile vs 512"):
        LayerTimeFit.load(path, model=other)
    with pytest.raises(ValueError, match=r"p\.json.*tensor-parallel size 1, not 2"):
        ProfiledCostModel.load(path, 1, LINK, model=MODEL, tensor_parallel=2)
    # a different layer count is fine: the profile is per layer
    LayerTimeFit.load(path, model=ModelDims(num_layers=96, hidden_size=256, num_attention_heads=4))


@pytest.mark.parametrize("damage,message", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),
    (lambda text: json.dumps({"hello": 1}), "not a megatron-terapipe layer profile"),
    (lambda text: text.replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 99'), "version 99"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "fit"}), "missing"),
    (lambda text: text.replace('"coef": [', '"coef": [1.0, '), "inconsistent shapes"),
])
def test_malformed_files_raise_clear_errors(tmp_path, damage, message):
    good = fit_layer_times(synthetic()).save(tmp_path / "good.json")
    bad = tmp_path / "bad.json"
    bad.write_text(damage(good.read_text()))
    with pytest.raises(ValueError, match=message) as exc:
        LayerTimeFit.load(bad)
    assert "bad.json" in str(exc.value)


def test_missing_file():
    with pytest.raises(ValueError, match="cannot read layer profile"):
        LayerTimeFit.load("/nonexistent/x.json")


def test_fit_needs_context_free_cells():
    m = synthetic()
    with pytest.raises(ValueError, match="context 0"):
        fit_layer_times(m.subset(m.context > 0))


def _brute_force_non_decreasing(values, weights):
    """Every split of the lengths into runs, each run at its weighted mean: the best whose
    means do not decrease (the least-squares non-decreasing fit is one of these)."""
    n, best = len(values), None
    for cuts in range(2 ** (n - 1)):
        bounds = [0] + [i + 1 for i in range(n - 1) if cuts >> i & 1] + [n]
        fit = np.concatenate([np.full(b - a, np.average(values[a:b], weights=weights[a:b]))
                              for a, b in zip(bounds, bounds[1:])])
        if np.all(np.diff(fit) >= -1e-12):
            cost = float(np.sum(weights * (fit - values) ** 2))
            if best is None or cost < best[0] - 1e-15:
                best = (cost, fit)
    return best[1]


def test_the_length_table_is_the_nearest_non_decreasing_one():
    # isotonic regression of the per-length medians equals brute force on small random cases,
    # leaves a non-decreasing table as it is, and pools a dip with what came before it
    from megatron_terapipe.planner.profile.least_squares import non_decreasing

    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 7))
        values, weights = rng.random(n), rng.integers(1, 4, n).astype(float)
        np.testing.assert_allclose(non_decreasing(values, weights),
                                   _brute_force_non_decreasing(values, weights), atol=1e-12)
    rising = np.array([1.0, 2.0, 2.0, 5.0])
    np.testing.assert_array_equal(non_decreasing(rising, np.ones(4)), rising)
    # a high cell no longer lifts every longer length to it (the running maximum did)
    np.testing.assert_allclose(non_decreasing(np.array([1.7, 1.9, 1.5, 1.6, 2.4]), np.ones(5)),
                               [1.675] * 4 + [2.4])
