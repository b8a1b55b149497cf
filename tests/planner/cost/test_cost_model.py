"""Analytic and function cost models: shapes, monotonicity, closed forms of the counts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_terapipe.planner import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    AnalyticCostModel,
    FunctionCostModel,
    LayerMemory,
    ModelDims,
    hardware_preset,
    model_preset,
)
from harness.inputs.cost_models import analytic


def test_vectorised_and_scalar_calls():
    cost = analytic()
    b = np.array([1, 2, 4])[:, None, None]
    l = np.array([8, 64, 512])[None, :, None]
    c = np.array([0, 256, 1024])[None, None, :]
    for fn in (cost.forward_time, cost.backward_time, cost.slice_time, cost.activation_bytes):
        out = fn(b, l, c)
        assert out.shape == (3, 3, 3)
        assert fn(2, 64, 256) == pytest.approx(out[1, 1, 1])
        assert isinstance(fn(2, 64, 256), float)
    assert cost.transfer_time(b[..., 0], l[..., 0]).shape == (3, 3)
    assert cost.kv_bytes(b[..., 0], l[..., 0]).shape == (3, 3)
    assert cost.slice_time(2, 64, 8) == pytest.approx(cost.forward_time(2, 64, 8) + cost.backward_time(2, 64, 8))


@pytest.mark.parametrize("model", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("hardware", sorted(HARDWARE_PRESETS))
def test_monotone_in_rows_length_and_context(model, hardware):
    """More rows, more context: never cheaper. More tokens: never cheaper without the prefix's
    cost per earlier slice; with it (v100, fitted to the paper's implementation), a thin slice
    behind a long prefix counts as more pieces than a longer one (the slicer assumes no
    monotonicity)."""
    tp = 8 if model != "gpt3-1b" else 1
    cost = analytic(model, hardware, layers=2, tensor_parallel=tp)
    b = np.array([1, 2, 8])[:, None, None]
    l = np.arange(8, 4097, 8)[None, :, None]
    c = np.arange(0, 4097, 64)[None, None, :]
    t = cost.slice_time(b, l, c)
    assert np.all(np.diff(t, axis=0) >= 0)
    assert np.all(np.diff(t, axis=2) >= 0)
    plain = AnalyticCostModel(cost.model, replace(cost.hardware, prefix_slice_overhead=0.0), 2,
                              tensor_parallel=tp)
    assert np.all(np.diff(plain.slice_time(b, l, c), axis=1) >= 0)
    assert np.all(np.diff(t[:, :, :1], axis=1) >= 0)  # no prefix: monotone in length too


def test_short_slices_underuse_the_gpu():
    """A layer pass costs its FLOPs at the GEMM efficiency of the cell's rows (E n / (n + n½)),
    plus the fixed cost per pass: per token, short slices cost more than long ones, and long
    ones scale with their length; backward is twice the forward."""
    cost = analytic("gpt3-1b", "v100")
    hw = cost.hardware
    for tokens in (1, 16, 256, 2048):
        flops = cost.layer_flops(1, tokens, 0)
        expected = max(flops / (hw.peak_flops * hw.gemm_efficiency(tokens)),
                       cost.layer_bytes(1, tokens, 0) / hw.memory_bandwidth) + hw.layer_overhead
        assert cost.forward_time(1, tokens, 0) == pytest.approx(cost.layers_per_stage * expected)
    per_token = [cost.forward_time(1, n, 0) / n for n in (16, 256, 2048)]
    assert per_token[0] > per_token[1] > per_token[2]
    assert cost.forward_time(1, 2048, 0) / cost.forward_time(1, 1024, 0) == pytest.approx(2.0, rel=0.1)
    assert cost.backward_time(1, 2048, 0) == pytest.approx(2 * cost.forward_time(1, 2048, 0), rel=0.05)


def test_the_prefix_costs_per_earlier_slice():
    """The K/V prefix's fixed part: prefix_slice_overhead per earlier slice of the cell's
    length, per layer pass (twice in backward)."""
    cost = analytic("gpt3-1b", "v100")
    planted = AnalyticCostModel(cost.model, replace(cost.hardware, prefix_slice_overhead=1e-3),
                                cost.layers_per_stage)
    base = AnalyticCostModel(cost.model, replace(cost.hardware, prefix_slice_overhead=0.0),
                             cost.layers_per_stage)
    extra = planted.forward_time(1, 128, 512) - base.forward_time(1, 128, 512)
    assert extra == pytest.approx(cost.layers_per_stage * 4 * 1e-3)
    extra_b = planted.backward_time(1, 128, 512) - base.backward_time(1, 128, 512)
    assert extra_b == pytest.approx(2 * extra)


def test_flops_closed_form_and_tensor_parallel():
    m = ModelDims(num_layers=2, hidden_size=1024, num_attention_heads=8, name="t")
    cost = AnalyticCostModel(m, hardware_preset("a100"), 1)
    b, l, c, h = 2, 128, 256, 1024
    dense = 24 * b * l * h * h  # QKV 6, out 2, MLP 16 (times b l h^2)
    attention = 4 * b * h * (l * c + l * (l + 1) / 2)
    assert cost.layer_flops(b, l, c) == pytest.approx(dense + attention)
    tp4 = AnalyticCostModel(m, hardware_preset("a100"), 1, tensor_parallel=4)
    assert tp4.layer_flops(b, l, c) == pytest.approx((dense + attention) / 4)
    unfused = AnalyticCostModel(m, hardware_preset("a100"), 1, flash_attention=False)
    assert unfused.layer_flops(b, l, c) == pytest.approx(dense + 4 * b * h * l * (c + l))


def test_memory_closed_forms():
    """Korthikanti et al. 2022: s b h (10 + 24/t) + 5 a s^2 b / t bytes per layer without
    recomputation (16-bit); the K and V inputs of Q K^T and P V (4 s b h / t) move to kv_bytes."""
    m = model_preset("gpt3-13b")
    s, b, t = 2048, 2, 4
    h, a = m.hidden_size, m.num_attention_heads
    mem = LayerMemory(m, tensor_parallel=t, dtype_bytes=2, flash_attention=False)
    paper = s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t
    assert mem.activation_bytes(b, s, 0) + mem.kv_bytes(b, s) == pytest.approx(paper)
    cost = AnalyticCostModel(m, hardware_preset("v100"), 5, tensor_parallel=t)
    assert cost.kv_bytes(b, 100) == pytest.approx(5 * 2 * b * 100 * h * 2 / t)
    # a slice's activations grow with its context only through the score matrix (unfused)
    assert mem.activation_bytes(b, 64, 1024) > mem.activation_bytes(b, 64, 0)
    fused = LayerMemory(m, tensor_parallel=t, flash_attention=True)
    assert fused.activation_bytes(b, 64, 1024) == fused.activation_bytes(b, 64, 0)


def test_transfer_time_uses_the_link():
    hw = hardware_preset("v100")
    m = model_preset("gpt3-1b")
    intra = AnalyticCostModel(m, hw, 1)
    inter = AnalyticCostModel(m, hw, 1, inter_node=True)
    nbytes = 4 * 256 * m.hidden_size * 2
    assert intra.transfer_time(4, 256) == pytest.approx(hw.intra_node.latency + nbytes / hw.intra_node.bandwidth)
    assert inter.transfer_time(4, 256) == pytest.approx(hw.inter_node.latency + nbytes / hw.inter_node.bandwidth)


def test_preset_sizes_match_their_names():
    """Layer parameters (12 h^2 per layer) add up to the parameter counts in the names."""
    for name, billions in (("gpt3-13b", 13), ("gpt3-44b", 44), ("gpt3-175b", 175)):
        m = model_preset(name)
        assert m.params_per_layer * m.num_layers / 1e9 == pytest.approx(billions, rel=0.05)


def test_invalid_dimensions():
    with pytest.raises(ValueError, match="divisible"):
        ModelDims(num_layers=2, hidden_size=1000, num_attention_heads=16)
    with pytest.raises(ValueError, match="num_layers"):
        ModelDims(num_layers=0, hidden_size=1024, num_attention_heads=16)
    with pytest.raises(ValueError, match="num_query_groups"):
        ModelDims(num_layers=2, hidden_size=1024, num_attention_heads=16, num_query_groups=3)
    with pytest.raises(ValueError, match="tensor-parallel"):
        analytic("gpt3-1b", tensor_parallel=3)
    with pytest.raises(ValueError, match="preset"):
        model_preset("gpt5")


def test_grouped_query_attention_shrinks_kv():
    mha = ModelDims(num_layers=1, hidden_size=4096, num_attention_heads=32)
    gqa = ModelDims(num_layers=1, hidden_size=4096, num_attention_heads=32, num_query_groups=8)
    assert LayerMemory(gqa).kv_bytes(1, 128) * 4 == LayerMemory(mha).kv_bytes(1, 128)
    assert gqa.params_per_layer < mha.params_per_layer


def test_function_cost_model_defaults():
    cost = FunctionCostModel(lambda b, l, c: b * l + c)
    assert cost.backward_time(2, 3, 4) == 2 * cost.forward_time(2, 3, 4) == 20.0
    assert cost.transfer_time(2, 3) == 0.0
    assert cost.activation_bytes(2, 3, 4) == cost.kv_bytes(2, 3) == 6.0
