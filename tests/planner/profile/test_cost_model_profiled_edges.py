"""Edge costs in measured profiles: the a + b * tokens fit, JSON round trip, older files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_terapipe.planner import (
    EdgeMeasurements,
    LayerTimeFit,
    ModelDims,
    ProfiledCostModel,
    fit_edge_times,
    fit_layer_times,
    simulate,
)
from megatron_terapipe.planner.profile.time_fit import FORMAT_VERSION
from megatron_terapipe.planner.profile.time_samples import EDGE_KEYS
from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.schedule import build_schedule
from harness.inputs.cost_models import LINK, MODEL, synthetic

TRUE = {"embedding_forward": (2e-5, 1e-8), "embedding_backward": (4e-4, 2e-8),
        "output_forward": (1e-4, 3e-7), "output_backward": (2e-4, 6e-7)}


def edge_measurements(noise=0.0, vocab=512):
    b = np.array([1, 1, 1, 1, 2, 2, 2, 2], dtype=float)
    l = np.array([16, 64, 256, 1024] * 2, dtype=float)
    rng = np.random.default_rng(0)
    cols = {k: (a + s * b * l) * (1 + noise * rng.standard_normal(len(b))) for k, (a, s) in TRUE.items()}
    return EdgeMeasurements(b, l, **cols, metadata={"vocab_size": vocab,
                                                    "position_embedding_type": "learned_absolute"})


def profile_with_edges(vocab=512):
    m = synthetic()
    m.edges = edge_measurements(vocab=vocab)
    return fit_layer_times(m)


def test_edge_fit_recovers_a_plus_b_tokens():
    fit = fit_edge_times(edge_measurements())
    for k, (a, s) in TRUE.items():
        assert fit.coef[k] == pytest.approx((a, s), rel=1e-6)
    assert fit.seconds("output", "backward", 2, 100) == pytest.approx(2e-4 + 6e-7 * 200)
    noisy = fit_edge_times(edge_measurements(noise=0.05))
    assert all(a >= 0 and s > 0 for a, s in noisy.coef.values())


def test_edge_fit_never_goes_negative():
    flat = edge_measurements()
    flat.output_forward = np.full(len(flat), 1e-4) * np.linspace(1.02, 1.0, len(flat))  # falls
    flat.embedding_forward = 1e-8 * flat.batch * flat.length - 1e-7  # negative intercept
    fit = fit_edge_times(flat)
    assert fit.coef["output_forward"][1] == 0.0 and fit.coef["output_forward"][0] > 0
    assert fit.coef["embedding_forward"][0] == 0.0 and fit.coef["embedding_forward"][1] > 0
    assert all(a >= 0 and s >= 0 for a, s in fit.coef.values())
    with pytest.raises(ValueError, match="vocab_size"):
        fit_edge_times(EdgeMeasurements([1], [8], [1.0], [1.0], [1.0], [1.0]))


def test_round_trip_with_edges(tmp_path):
    fit = profile_with_edges()
    path = fit.save(tmp_path / "profile.json")
    data = json.loads(path.read_text())
    assert data["format_version"] == FORMAT_VERSION == 3
    assert data["edges"]["metadata"]["vocab_size"] == 512
    assert set(data["edges"]["fit"]) == set(EDGE_KEYS)
    loaded = LayerTimeFit.load(path, model=MODEL, tensor_parallel=1)
    assert loaded.edges.coef == fit.edges.coef
    assert len(loaded.edges.measurements) == 8
    assert loaded.measurements.edges is loaded.edges.measurements
    cost = ProfiledCostModel.load(path, layers_per_stage=2, link=LINK)
    assert cost.model.vocab_size == 512  # from the edges when no model is given
    assert "edges measured (vocab 512" in cost.describe()
    b, l = np.array([1, 2, 4]), np.array([64, 128, 999])
    emb = fit.edges.seconds("embedding", "forward", b, l)
    out = fit.edges.seconds("output", "forward", b, l)
    assert cost.edge_forward_time(b, l, True, False) == pytest.approx(emb)
    assert cost.edge_forward_time(b, l, False, True) == pytest.approx(out)
    assert cost.edge_forward_time(b, l, True, True) == pytest.approx(emb + out)
    assert cost.edge_backward_time(1, 64, False, False) == 0.0
    # edges are not per layer: 2 layers per stage double forward_time, not the edges
    assert cost.edge_backward_time(1, 64, False, True) == pytest.approx(2e-4 + 6e-7 * 64, rel=1e-6)
    result = simulate(build_schedule(TeraPipePlan([512, 512]), 1, 2, 1), cost)
    assert result.iteration_time > simulate(build_schedule(TeraPipePlan([512, 512]), 1, 2, 1),
                                            ProfiledCostModel(fit.with_edges(None), 2, LINK)).iteration_time


def test_old_format_loads_without_edges(tmp_path):
    data = fit_layer_times(synthetic()).to_dict()
    data["format_version"] = 1
    del data["edges"]  # what version 1 wrote
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    fit = LayerTimeFit.load(path, model=MODEL, tensor_parallel=1)
    assert fit.edges is None and fit.format_version == 1
    # a vocab size on the requested model is fine: the old profile just has no edges
    with_vocab = ModelDims(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=50257)
    cost = ProfiledCostModel.load(path, layers_per_stage=2, link=LINK, model=with_vocab)
    assert cost.edge_forward_time(2, 128, True, True) == 0.0
    assert cost.edge_backward_time(np.array([1, 2]), 128, True, True).tolist() == [0.0, 0.0]
    assert "format version 1" in cost.describe() and "count as 0" in cost.describe()
    # a current profile measured without a vocab size says so too
    plain = ProfiledCostModel(fit_layer_times(synthetic()), 2, LINK)
    assert "without a vocab size" in plain.describe()


def test_vocab_mismatch_is_refused(tmp_path):
    path = profile_with_edges(vocab=512).save(tmp_path / "p.json")
    other = ModelDims(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1024)
    with pytest.raises(ValueError, match=r"p\.json.*vocab size 512, not 1024"):
        ProfiledCostModel.load(path, 1, LINK, model=other)
    same = ModelDims(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=512)
    ProfiledCostModel.load(path, 1, LINK, model=same)


def test_malformed_edges_raise(tmp_path):
    data = profile_with_edges().to_dict()
    data["edges"]["fit"]["output_forward"] = [1.0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bad.json.*pairs"):
        LayerTimeFit.load(bad)
    del data["edges"]["fit"]["output_forward"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bad.json.*edge"):
        LayerTimeFit.load(bad)
