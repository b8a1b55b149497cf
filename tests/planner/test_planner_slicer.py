"""The DP slicer is exact: it matches exhaustive search on small instances."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner import (
    AnalyticCostModel,
    FunctionCostModel,
    best_uniform_slicing,
    hardware_preset,
    model_preset,
    plan_objective,
    solve,
    solve_slicing,
)
from megatron_terapipe.planner.slicer import (bottleneck_cell_time, resolve_batch_sizes,
                                              slicing_unit)


# ---- exhaustive search -------------------------------------------------------------------------

def compositions(units: int):
    """Every way to write `units` as an ordered sum of positive integers."""
    for cuts in itertools.product((False, True), repeat=units - 1):
        parts, run = [], 1
        for cut in cuts:
            if cut:
                parts.append(run)
                run = 1
            else:
                run += 1
        parts.append(run)
        yield parts


def batch_partitions(rows: int, sizes):
    """Multisets of allowed sizes adding up to `rows` (non-increasing tuples)."""
    def rec(left, largest):
        if left == 0:
            yield ()
            return
        for b in sorted(sizes, reverse=True):
            if b <= min(left, largest):
                for rest in rec(left - b, b):
                    yield (b,) + rest
    yield from rec(rows, rows)


def brute_force(cost, seq_length, unit, micro_batch_size, K, M, sizes, include_transfer=True):
    """Least objective over every plan: each batch slice gets its own token slicing.

    Every plan's objective, M * sum(t) + (K - 1) * max(u) over its cells as plan_objective
    writes it, is built from each token slicing's sum and max per batch slice, combined for
    all the plans of a batch partition at once."""
    units = seq_length // unit
    slicings = [[k * unit for k in comp] for comp in compositions(units)]
    best = np.inf
    for parts in batch_partitions(micro_batch_size, sizes):
        sums, maxes = np.zeros(1), np.zeros(1)  # per combination of the parts' slicings so far
        for rows in parts:
            part_sums, part_maxes = _slicing_terms(cost, slicings, rows, K, include_transfer)
            sums = np.add.outer(sums, part_sums).ravel()
            maxes = np.maximum.outer(maxes, part_maxes).ravel()
        best = min(best, float((M * sums + (K - 1) * maxes).min()))
    return best


def _slicing_terms(cost, slicings, rows, K, include_transfer):
    """Per token slicing of a `rows`-row batch slice: the sum of its cells' t and the largest u."""
    lengths = np.concatenate([np.asarray(s, dtype=np.float64) for s in slicings])
    contexts = np.concatenate([np.cumsum([0, *s[:-1]], dtype=np.float64) for s in slicings])
    b = np.full_like(lengths, rows)
    t = bottleneck_cell_time(cost, b, lengths, contexts, K)
    u = t + 2 * np.asarray(cost.transfer_time(b, lengths)) if include_transfer else t
    starts = np.cumsum([0, *[len(s) for s in slicings[:-1]]])
    return np.add.reduceat(t, starts), np.maximum.reduceat(u, starts)


def table_cost_model(slice_table: np.ndarray, transfer_table: np.ndarray, unit: int):
    """slice_table[b, k, c]: stage time of b rows, k units, c units of context."""
    def forward(b, l, c):
        return slice_table[b.astype(int), (l // unit).astype(int), (c // unit).astype(int)] / 3.0

    def transfer(b, l):
        return transfer_table[b.astype(int), (l // unit).astype(int)]

    return FunctionCostModel(forward, backward_ratio=2.0, transfer=transfer, name="table")


@st.composite
def monotone_instances(draw):
    """Random cost tables increasing in length and in context (and in rows)."""
    units = draw(st.integers(1, 5))
    rows = draw(st.integers(1, 3))
    unit = draw(st.sampled_from([1, 2, 8]))
    K = draw(st.integers(1, 12))  # deep pipelines make the max term matter
    M = draw(st.integers(1, 3))
    shape = (rows + 1, units + 1, units + 1)
    increments = draw(st.lists(st.floats(0.0, 10.0, allow_nan=False, width=32),
                               min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    inc = np.expm1(np.asarray(increments, dtype=np.float64).reshape(shape) / 3.0)  # wide spread
    # cumulative sums of non-negative increments: non-decreasing along rows, length, context
    table = inc.cumsum(0).cumsum(1).cumsum(2) + draw(st.floats(0.01, 5.0))
    transfer_inc = draw(st.lists(st.floats(0.0, 2.0, allow_nan=False, width=32),
                                 min_size=(rows + 1) * (units + 1), max_size=(rows + 1) * (units + 1)))
    transfer = np.asarray(transfer_inc).reshape(rows + 1, units + 1).cumsum(1)
    sizes = draw(st.sampled_from(["divisors", "all", "none"]))
    return units, rows, unit, K, M, table, transfer, sizes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(monotone_instances(), st.booleans())
def test_dp_equals_exhaustive_search(instance, include_transfer):
    units, rows, unit, K, M, table, transfer, sizes = instance
    cost = table_cost_model(table, transfer, unit)
    seq = units * unit
    solution = solve_slicing(cost, seq, rows, K, granularity=unit, num_microbatches=M,
                             batch_sizes=sizes, include_transfer=include_transfer)
    allowed = resolve_batch_sizes(sizes, rows)
    expected = brute_force(cost, seq, unit, rows, K, M, allowed, include_transfer)
    assert solution.objective == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # the reported objective is the plan's own objective
    again = plan_objective(solution.plan, cost, rows, K, M, include_transfer)
    assert again == pytest.approx(solution.objective, rel=1e-9, abs=1e-12)
    solution.plan.validate(seq, rows, multiple_of=unit)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 3), st.data())
def test_dp_exact_for_non_monotone_costs(units, K, M, data):
    """No monotonicity is assumed: arbitrary positive tables are solved exactly too."""
    rows = data.draw(st.integers(1, 2))
    values = data.draw(st.lists(st.floats(0.01, 10.0), min_size=(rows + 1) * (units + 1) ** 2,
                                max_size=(rows + 1) * (units + 1) ** 2))
    table = np.asarray(values).reshape(rows + 1, units + 1, units + 1)
    cost = table_cost_model(table, np.zeros((rows + 1, units + 1)), 1)
    solution = solve_slicing(cost, units, rows, K, granularity=1, num_microbatches=M,
                             batch_sizes="all")
    expected = brute_force(cost, units, 1, rows, K, M, resolve_batch_sizes("all", rows))
    assert solution.objective == pytest.approx(expected, rel=1e-9)


# ---- realistic models -------------------------------------------------------------------------

def gpt_cost(model="gpt3-13b", hardware="v100", layers=5, tp=1):
    return AnalyticCostModel(model_preset(model), hardware_preset(hardware), layers, tensor_parallel=tp)


@pytest.mark.parametrize("K,M,B", [(2, 1, 1), (8, 1, 2), (8, 4, 4), (24, 2, 8), (40, 1, 16)])
def test_never_worse_than_uniform_or_no_slicing(K, M, B):
    cost = gpt_cost()
    seq, g = 2048, 32
    solution = solve_slicing(cost, seq, B, K, granularity=g, num_microbatches=M)
    _, uniform_value = best_uniform_slicing(cost, seq, B, K, granularity=g, num_microbatches=M)
    whole = plan_objective(TeraPipePlan([seq]), cost, B, K, M)
    assert solution.objective <= uniform_value * (1 + 1e-12)
    assert solution.objective <= whole * (1 + 1e-12)
    assert solution.objective == pytest.approx(
        plan_objective(solution.plan, cost, B, K, M), rel=1e-12)


def test_more_stages_mean_more_slices():
    """The (K-1) max term rewards shorter slices as the pipeline deepens."""
    cost = gpt_cost(layers=1)
    counts = [len(solve_slicing(cost, 2048, 1, K, granularity=16, batch_sizes="none").plan.seq_slices)
              for K in (1, 4, 16, 64)]
    assert counts[0] == 1  # one stage: nothing to overlap, slicing only adds overhead
    assert counts == sorted(counts) and counts[-1] > 1


def test_plan_fields_and_multiple_of():
    cost = gpt_cost()
    assert slicing_unit(1536, 16, 24) == 48  # slices must be multiples of both
    plan = solve(cost, 1536, 4, 8, granularity=16, num_microbatches=2, order="gpipe",
                 multiple_of=24, simulate=False)
    assert plan.order == "gpipe"
    plan.validate(1536, 4, multiple_of=48)
    # without simulation, the prediction is the objective itself
    assert plan.predicted_time == pytest.approx(plan_objective(plan, cost, 4, 8, 2), rel=1e-12)


def test_predicted_time_is_the_simulators():
    from megatron_terapipe.planner import simulate
    from megatron_terapipe.schedule import build_schedule

    cost = gpt_cost()
    plan = solve(cost, 1024, 2, 4, granularity=64, num_microbatches=3)
    simulated = simulate(build_schedule(plan, 3, 4, 2), cost).iteration_time
    assert plan.predicted_time == pytest.approx(simulated)


def test_input_errors_name_the_problem():
    cost = gpt_cost()
    with pytest.raises(ValueError, match="multiple of the slice unit"):
        solve_slicing(cost, 1000, 1, 4, granularity=64)
    with pytest.raises(ValueError, match="granularity"):
        solve_slicing(cost, 1024, 1, 4, granularity=0)
    with pytest.raises(ValueError, match="num_stages"):
        solve_slicing(cost, 1024, 1, 0, granularity=64)
    with pytest.raises(ValueError, match="cannot add up"):
        solve_slicing(cost, 1024, 5, 4, granularity=64, batch_sizes=[2, 4])
    with pytest.raises(ValueError, match="batch_sizes"):
        solve_slicing(cost, 1024, 4, 4, granularity=64, batch_sizes="some")


def test_batch_slicing_helps_when_the_pipeline_is_starved():
    """One microbatch of many rows on a deep pipeline: splitting rows adds cells to overlap."""
    cost = gpt_cost(layers=1)
    with_rows = solve_slicing(cost, 512, 16, 32, granularity=64, batch_sizes="divisors")
    tokens_only = solve_slicing(cost, 512, 16, 32, granularity=64, batch_sizes="none")
    assert with_rows.objective <= tokens_only.objective
    assert with_rows.plan.num_batch_slices > 1


def test_paper_size_plan_is_exact_and_beats_uniform():
    """seq 2048, granularity 8, 32 rows, 40 stages (how fast: benchmarks/bench_planner.py)."""
    cost = AnalyticCostModel(model_preset("gpt3-175b"), hardware_preset("v100"), 2,
                             tensor_parallel=8, inter_node=True)
    solution = solve_slicing(cost, 2048, 32, 40, granularity=8)
    assert solution.plan.seq_length == 2048
    solution.plan.validate(2048, 32, multiple_of=8)
    assert solution.objective == pytest.approx(plan_objective(solution.plan, cost, 32, 40), rel=1e-12)
    _, uniform = best_uniform_slicing(cost, 2048, 32, 40, granularity=8)
    assert solution.objective <= uniform * (1 + 1e-12)


def test_dp_equals_exhaustive_search_seeded_sweep():
    """A fixed sweep of deep-pipeline instances, where the max term decides the plan."""
    rng = np.random.default_rng(20210721)
    for _ in range(250):
        units, rows = int(rng.integers(2, 6)), int(rng.integers(1, 4))
        K, M = int(rng.integers(4, 16)), int(rng.integers(1, 3))
        table = rng.exponential(1.0, size=(rows + 1, units + 1, units + 1)).cumsum(0).cumsum(1).cumsum(2)
        transfer = rng.exponential(0.2, size=(rows + 1, units + 1)).cumsum(1)
        cost = table_cost_model(table + 0.05, transfer, 1)
        solution = solve_slicing(cost, units, rows, K, granularity=1, num_microbatches=M,
                                 batch_sizes="all")
        expected = brute_force(cost, units, 1, rows, K, M, resolve_batch_sizes("all", rows))
        assert solution.objective == pytest.approx(expected, rel=1e-9)


def test_solve_is_within_the_fewer_cells_tolerance_of_uniform_or_no_slicing():
    from megatron_terapipe.planner import (AnalyticCostModel, best_uniform_slicing,
                                           hardware_preset, model_preset, simulate, solve)
    from megatron_terapipe.schedule import build_schedule

    cost = AnalyticCostModel(model_preset("gpt3-1b"), hardware_preset("v100"), layers_per_stage=3)
    for K, M, order in [(2, 1, "1f1b"), (4, 3, "gpipe"), (8, 2, "1f1b")]:
        plan = solve(cost, 2048, 2, K, granularity=64, num_microbatches=M, order=order)
        timed = lambda p: simulate(build_schedule(p, M, K, 2), cost).iteration_time
        assert plan.predicted_time == pytest.approx(timed(plan))
        uniform, _ = best_uniform_slicing(cost, 2048, 2, K, granularity=64, num_microbatches=M,
                                          order=order)
        # fewer_cells may trade up to 0.5% of simulated time for fewer cells
        assert plan.predicted_time <= timed(uniform) * (1 + 5e-3 + 1e-12)
        assert plan.predicted_time <= timed(TeraPipePlan([2048], order=order)) * (1 + 5e-3 + 1e-12)
