"""Edge costs: the first stage's embedding and the last stage's output layer and loss.

Default zero (layers only), the simulator adds them on the first / last stage only, the
analytic model's counts, and solve's prediction includes them while the objective does not.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner import (
    AnalyticCostModel,
    FunctionCostModel,
    ModelDims,
    hardware_preset,
    model_preset,
    plan_objective,
    simulate,
    solve,
)
from megatron_terapipe.schedule import build_schedule

TF, TB = 1.0, 2.0  # layer forward / backward of every cell on every stage
EMB_F, EMB_B = 0.25, 0.125  # first stage's extra seconds per cell
OUT_F, OUT_B = 0.5, 0.75  # last stage's extra seconds per cell


def const(value):
    return lambda *args: np.full(np.broadcast(*args).shape, value)


def edge(emb, out):
    def fn(b, l, first, last):
        assert first.dtype == bool and last.dtype == bool  # flags arrive as booleans
        return np.where(first, emb, 0.0) + np.where(last, out, 0.0) + 0.0 * b * l
    return fn


def edged_cost(**kw):
    return FunctionCostModel(const(TF), backward=const(TB), edge_forward=edge(EMB_F, OUT_F),
                             edge_backward=edge(EMB_B, OUT_B), **kw)


def test_edges_default_to_zero():
    plain = FunctionCostModel(const(TF), backward=const(TB))
    assert plain.edge_forward_time(2, 64, True, True) == 0.0
    assert isinstance(plain.edge_backward_time(2, 64, True, False), float)
    out = plain.edge_forward_time(np.array([1, 2])[:, None], np.array([8, 16, 32]), True, False)
    assert out.shape == (2, 3) and not out.any()
    # the analytic model without a vocabulary size has none either
    dims = ModelDims(num_layers=4, hidden_size=1024, num_attention_heads=8)
    cost = AnalyticCostModel(dims, hardware_preset("a100"), 2)
    assert cost.edge_forward_time(4, 512, True, True) == 0.0
    assert cost.edge_backward_time(4, 512, True, True) == 0.0
    assert "vocab_size" not in dims.to_dict()  # profile cache keys of such models are unchanged


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 3])
def test_simulator_adds_edges_on_first_and_last_stage(K, n):
    """GPipe order, n equal cells: identical jobs in a flow shop, so each direction takes
    sum over stages of the per-cell time + (n - 1) x the largest one. Stage 0 adds the
    embedding, stage K-1 the output layer; a 1-stage pipeline adds both."""
    plan = TeraPipePlan.uniform(64 * n, n, order="gpipe")
    result = simulate(build_schedule(plan, 1, K, 1), edged_cost())
    fwd = [TF + EMB_F * (k == 0) + OUT_F * (k == K - 1) for k in range(K)]
    bwd = [TB + EMB_B * (k == 0) + OUT_B * (k == K - 1) for k in range(K)]
    expected = sum(fwd) + (n - 1) * max(fwd) + sum(bwd) + (n - 1) * max(bwd)
    assert result.iteration_time == pytest.approx(expected)
    assert result.busy == pytest.approx([n * (f + b) for f, b in zip(fwd, bwd)])
    if K > 2:  # middle stages: layers only
        assert result.busy[1] == pytest.approx(n * (TF + TB))
    durations = {(ta.stage, ta.action.kind): ta.end - ta.start for ta in result.timeline}
    assert durations[(0, "F")] == pytest.approx(fwd[0])
    assert durations[(K - 1, "B")] == pytest.approx(bwd[-1])


def test_simulator_without_edges_is_unchanged():
    plan = TeraPipePlan.uniform(256, 4, order="1f1b")
    schedule = build_schedule(plan, 3, 4, 1)
    plain = FunctionCostModel(const(TF), backward=const(TB))
    zeros = FunctionCostModel(const(TF), backward=const(TB), edge_forward=edge(0.0, 0.0),
                              edge_backward=edge(0.0, 0.0))
    a, b = simulate(schedule, plain), simulate(schedule, zeros)
    assert a.iteration_time == b.iteration_time == pytest.approx((12 + 4 - 1) * (TF + TB))


def test_negative_edge_times_are_refused():
    bad = FunctionCostModel(const(TF), edge_forward=edge(-1.0, 0.0))
    with pytest.raises(ValueError, match="non-negative"):
        simulate(build_schedule(TeraPipePlan([64]), 1, 2, 1), bad)


def test_solve_predicts_with_edges_and_optimises_the_bottleneck_stage():
    cost = edged_cost()
    plan = solve(cost, 256, 1, 3, granularity=64, num_microbatches=2)
    simulated = simulate(build_schedule(plan, 2, 3, 1), cost).iteration_time
    assert plan.predicted_time == pytest.approx(simulated)
    layers_only = FunctionCostModel(const(TF), backward=const(TB))
    # The objective counts the heavier edge on every cell (the slowest stage's cell time).
    assert plan_objective(plan, cost, 1, 3, 2) > plan_objective(plan, layers_only, 1, 3, 2)
    assert simulated > simulate(build_schedule(plan, 2, 3, 1), layers_only).iteration_time


# ---- analytic edges -------------------------------------------------------------------------

DIMS = ModelDims(num_layers=8, hidden_size=2048, num_attention_heads=16, vocab_size=50304)


@pytest.mark.parametrize("tp", [1, 4])
def test_analytic_edge_flops(tp):
    cost = AnalyticCostModel(DIMS, hardware_preset("a100"), 2, tensor_parallel=tp)
    b, l, h, V = 2, 1024, 2048, 50304
    assert cost.edge_flops("output", b, l) == pytest.approx(2 * b * l * h * V / tp)
    assert cost.edge_flops("embedding", b, l) == 0.0
    assert cost.edge_flops("output", np.array([1, 2]), 8).shape == (2,)
    with pytest.raises(ValueError, match="edge part"):
        cost.edge_flops("head", b, l)


def test_analytic_edge_times():
    hw = hardware_preset("a100")
    cost = AnalyticCostModel(DIMS, hw, 2)
    b, l, h, V, d = 4, 2048, 2048, 50304, 2
    # a long slice's output layer is compute bound: GEMM FLOPs at the achievable rate
    gemm = 2 * b * l * h * V / (hw.peak_flops * hw.gemm_efficiency(b * l))
    assert cost.edge_bytes("output", "forward", b, l) / hw.memory_bandwidth < gemm
    assert cost.edge_forward_time(b, l, False, True) == pytest.approx(gemm + hw.layer_overhead)
    assert cost.edge_backward_time(b, l, False, True) == pytest.approx(2 * gemm + 2 * hw.layer_overhead)
    # the embedding is memory bound; its backward writes and accumulates the whole table
    emb_f = cost.edge_forward_time(b, l, True, False)
    assert emb_f == pytest.approx(2 * b * l * h * d / hw.memory_bandwidth + hw.layer_overhead)
    table = V * h * (2 * d + 8) / hw.memory_bandwidth
    assert cost.edge_backward_time(1, 8, True, False) > table
    # one stage runs both; middle stages neither
    both = cost.edge_forward_time(b, l, True, True)
    assert both == pytest.approx(emb_f + cost.edge_forward_time(b, l, False, True))
    assert cost.edge_forward_time(b, l, False, False) == 0.0
    # vectorised, and growing with the tokens
    t = cost.edge_forward_time(1, np.arange(8, 4097, 8), True, True)
    assert t.shape == (512,) and np.all(np.diff(t) >= 0)


def test_presets_know_the_gpt2_vocabulary():
    m = model_preset("gpt3-13b")
    assert m.vocab_size == 50257
    cost = AnalyticCostModel(m, hardware_preset("v100"), 5)
    assert cost.edge_forward_time(1, 2048, False, True) > 0
    # with the edges, the last stage of a pipeline is busier than a middle one
    plan = TeraPipePlan.uniform(2048, 4)
    result = simulate(build_schedule(plan, 1, 4, 1), cost)
    assert result.busy[-1] > result.busy[1]
    with pytest.raises(ValueError, match="vocab_size"):
        replace(m, vocab_size=0)


def test_terapipe_plan_vocab_size_flag(capsys):
    from megatron_terapipe.planner.cli.command import main

    base = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8",
            "--pipeline-stages", "2", "--seq-length", "512", "--granularity", "64"]
    assert main(base) == 0
    assert "no vocab size: edge costs 0" in capsys.readouterr().out
    assert main(base + ["--vocab-size", "50304"]) == 0
    assert "output layer of vocab 50304" in capsys.readouterr().out
