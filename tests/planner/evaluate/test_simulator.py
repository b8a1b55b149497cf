"""The simulator against closed forms: pipeline fill and drain, bubbles, live memory."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner import FunctionCostModel, plan_objective, simulate
from megatron_terapipe.schedule import build_schedule


def constant_cost(tf=1.0, tb=2.0, transfer=0.0, act=1.0, kv=1.0):
    """Every cell takes tf forward, tb backward and holds `act` / `kv` bytes, whatever its shape."""
    return FunctionCostModel(lambda b, l, c: np.full(np.broadcast(b, l, c).shape, tf),
                             backward=lambda b, l, c: np.full(np.broadcast(b, l, c).shape, tb),
                             transfer=lambda b, l: np.full(np.broadcast(b, l).shape, transfer),
                             activation=lambda b, l, c: np.full(np.broadcast(b, l, c).shape, act),
                             kv=lambda b, l: np.full(np.broadcast(b, l).shape, kv))


shapes = st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 4))  # K, M, slices


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from([0.0, 0.25]))
def test_gpipe_uniform_cells_closed_form(shape, transfer):
    """N equal cells through K stages: (N + K - 1) t per direction, plus K-1 hops each way."""
    K, M, n = shape
    tf, tb = 1.0, 2.0
    plan = TeraPipePlan.uniform(64 * n, n, order="gpipe")
    result = simulate(build_schedule(plan, M, K, 1), constant_cost(tf, tb, transfer))
    N = M * n
    assert result.iteration_time == pytest.approx((N + K - 1) * (tf + tb) + 2 * (K - 1) * transfer)
    assert all(b == pytest.approx(N * (tf + tb)) for b in result.busy)
    if transfer == 0:
        assert result.bubble_fraction == pytest.approx((K - 1) / (N + K - 1))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8))
def test_1f1b_whole_microbatches_closed_form(K, M):
    """Megatron's 1F1B with one cell per microbatch: the same (M + K - 1)(tf + tb)."""
    plan = TeraPipePlan([128], order="1f1b")
    result = simulate(build_schedule(plan, M, K, 1), constant_cost(1.0, 2.0))
    assert result.iteration_time == pytest.approx((M + K - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx((K - 1) / (M + K - 1))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 6), st.integers(1, 4), st.data())
def test_gpipe_matches_the_slicer_objective(K, M, n, rows, data):
    """With backward = r x forward and no transfers, GPipe order is a flow shop whose
    makespan is exactly M * sum t + (K - 1) * max t: the slicer's objective."""
    lengths = data.draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    plan = TeraPipePlan([8 * x for x in lengths], order="gpipe")
    cost = FunctionCostModel(lambda b, l, c: 0.001 * b * l + 0.0001 * l * c + 0.01 + 0.0 * c,
                             backward_ratio=2.5)
    result = simulate(build_schedule(plan, M, K, rows), cost)
    assert result.iteration_time == pytest.approx(
        plan_objective(plan, cost, rows, K, M, include_transfer=False), rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 10), st.integers(1, 4))
def test_1f1b_bounds_live_activations(K, M, n):
    """Stage k of 1F1B holds at most (n - 1) + (K - k) cells; GPipe holds all M n."""
    plan = TeraPipePlan.uniform(32 * n, n, order="1f1b")
    cost = constant_cost(act=1.0, kv=0.0)
    one_f_one_b = simulate(build_schedule(plan, M, K, 1), cost)
    gpipe = simulate(build_schedule(TeraPipePlan.uniform(32 * n, n, order="gpipe"), M, K, 1), cost)
    for k in range(K):
        assert one_f_one_b.peak_activation_bytes[k] == min(M * n, n - 1 + K - k)
        assert gpipe.peak_activation_bytes[k] == M * n
    assert one_f_one_b.peak_activation_bytes[0] <= K * n  # at most K microbatches' worth
    if M > K:
        assert one_f_one_b.peak_activation_bytes[0] < gpipe.peak_activation_bytes[0]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 5))
def test_kv_lifetime(K, M, n):
    """GPipe keeps every sequence's K/V (a buffer for the whole sequence, from its first
    slice's forward) until its first slice's backward, plus the K/V gradient buffer (as large)
    that the first backward of the last sequence creates (a sequence of one slice has none:
    its K/V gradients live within a layer's backward); forward-only frees a sequence's K/V
    after its last slice, so at most one sequence's K/V are live."""
    plan = TeraPipePlan.uniform(16 * n, n, order="gpipe")
    cost = FunctionCostModel(lambda b, l, c: np.ones(np.broadcast(b, l, c).shape),
                             activation=lambda b, l, c: np.zeros(np.broadcast(b, l, c).shape),
                             kv=lambda b, l: b * l / 16)  # one byte per 16 tokens
    gpipe = simulate(build_schedule(plan, M, K, 1), cost)
    assert all(p == M * n + (n if n > 1 else 0) for p in gpipe.peak_kv_bytes)
    fwd = simulate(build_schedule(plan, M, K, 1, forward_only=True), cost)
    assert all(p == n for p in fwd.peak_kv_bytes)
    assert all(pt.kv_bytes == 0 for pt in fwd.memory[0][-1:])
    # every byte is released by the end of the iteration
    assert all(points[-1].kv_bytes == 0 and points[-1].activation_bytes == 0 for points in gpipe.memory)


def test_forward_only_activations_are_transient():
    plan = TeraPipePlan([32, 32, 64], order="1f1b")
    result = simulate(build_schedule(plan, 3, 2, 1, forward_only=True), constant_cost(act=5.0, kv=0.0))
    assert result.peak_activation_bytes == (5.0, 5.0)
    assert result.iteration_time == pytest.approx((9 + 1) * 1.0)


def test_busy_time_and_bubble_agree():
    plan = TeraPipePlan([96, 64, 64, 32], batch_slices=[2, 1], order="1f1b", defer_wgrad=False)
    cost = FunctionCostModel(lambda b, l, c: 1e-3 * b * (l + 0.1 * c) + 1e-3)
    result = simulate(build_schedule(plan, 3, 4, 3), cost)
    assert all(0 < busy <= result.iteration_time for busy in result.busy)
    idle = sum(result.iteration_time - busy for busy in result.busy)
    assert result.bubble_fraction == pytest.approx(idle / (len(result.busy) * result.iteration_time))
    assert 0 < result.bubble_fraction < 1
    assert len(result.timeline) == 4 * 2 * 3 * plan.num_cells


def test_cost_model_errors_are_reported():
    bad = FunctionCostModel(lambda b, l, c: -np.ones(np.broadcast(b, l, c).shape))
    with pytest.raises(ValueError, match="non-negative"):
        simulate(build_schedule(TeraPipePlan([8]), 1, 2, 1), bad)
