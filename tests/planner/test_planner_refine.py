"""Simulator-guided refinement of a plan's token slices (planner/hill_climb.py: refine)."""

import dataclasses
import itertools

import pytest

from megatron_terapipe import TeraPipePlan, build_schedule
from megatron_terapipe.planner import FunctionCostModel, fewer_cells, refine, simulate, solve


def _cost() -> FunctionCostModel:
    # attention-like context term, a per-cell overhead, and a heavy last-stage edge per token
    return FunctionCostModel(forward=lambda b, l, c: 1e-3 + 1e-4 * b * l * (1 + (c + l) / 64),
                             edge_forward=lambda b, l, first, last: 4e-4 * b * l * last)


def _time(plan, cost, M=1, K=2) -> float:
    return simulate(build_schedule(plan, M, K, 1), cost).iteration_time


def test_refine_never_worse_and_keeps_units_and_options():
    cost = _cost()
    for start in (TeraPipePlan([32, 32, 32, 32]), TeraPipePlan([128]),
                  TeraPipePlan([16, 48, 64], order="gpipe", defer_wgrad=True)):
        for M in (1, 3):
            refined, t = refine(start, cost, M, 2, 1, unit=16)
            assert t <= _time(start, cost, M) + 1e-15
            assert t == pytest.approx(_time(refined, cost, M))
            assert all(x % 16 == 0 for x in refined.seq_slices)
            assert sum(refined.seq_slices) == 128
            assert (refined.order, refined.defer_wgrad) == (start.order, start.defer_wgrad)


def test_refine_reaches_the_brute_force_optimum_on_a_small_case():
    """Unit 16, 128 tokens: all 2^7 compositions; the climb from one slice finds the best."""
    cost = _cost()
    def compositions():  # a cut or not after each of the first 7 units
        for cuts in itertools.product((False, True), repeat=7):
            slices, length = [], 16
            for cut in cuts:
                if cut:
                    slices.append(length)
                    length = 0
                length += 16
            yield slices + [length]

    best = min(_time(TeraPipePlan(s), cost) for s in compositions())
    refined, t = refine(TeraPipePlan([128]), cost, 1, 2, 1, unit=16, max_evaluations=1000)
    assert t == pytest.approx(best, rel=1e-12)


def test_refine_leaves_plans_it_cannot_move():
    cost = _cost()
    per_batch = TeraPipePlan([[64, 64], [32, 96]], batch_slices=[1, 1])
    refined, t = refine(per_batch, cost, 1, 2, 2, unit=16)
    assert refined == per_batch
    odd = TeraPipePlan([60, 68])  # not multiples of the unit
    assert refine(odd, cost, 1, 2, 1, unit=16)[0] == odd


def test_solve_refined_is_no_slower_than_unrefined():
    cost = _cost()
    plain = solve(cost, 128, 1, 2, granularity=16, refine=False)
    polished = solve(cost, 128, 1, 2, granularity=16)
    assert polished.predicted_time <= plain.predicted_time + 1e-15
    assert polished.predicted_time == pytest.approx(
        _time(dataclasses.replace(polished, predicted_time=None), cost))


def _flat_cost() -> FunctionCostModel:
    # time proportional to the tokens: more slices only shrink the pipeline's fill and drain,
    # by less and less, so many slice counts land within a fraction of a percent
    return FunctionCostModel(forward=lambda b, l, c: 1e-4 * b * l)


def test_fewer_cells_takes_the_fewest_slices_within_the_tolerance():
    cost = _flat_cost()
    start = TeraPipePlan.uniform(4096, 32, multiple_of=16)
    start_time = _time(start, cost)
    fewer, t = fewer_cells(start, cost, 1, 2, 1, unit=16)
    # brute force over the candidates it scans (16 to 31 slices: half of 32 to one less)
    within = [n for n in range(16, 32)
              if _time(TeraPipePlan.uniform(4096, n, multiple_of=16), cost) <= start_time * 1.005]
    assert within and len(fewer.seq_slices) == min(within) < 32
    assert t == pytest.approx(_time(fewer, cost)) and t <= start_time * 1.005
    assert t > start_time  # a real trade: slightly slower, fewer cells
    # with no tolerance nothing slower is taken; here every count below 32 is slower
    same, t0 = fewer_cells(start, cost, 1, 2, 1, unit=16, tolerance=0.0)
    assert same == start and t0 == pytest.approx(start_time)


def test_fewer_cells_keeps_options_and_leaves_what_it_cannot_slice():
    cost = _flat_cost()
    start = TeraPipePlan.uniform(4096, 32, order="gpipe", multiple_of=16)
    start = dataclasses.replace(start, defer_wgrad=True, wgrad_points=[[3]])
    fewer, _ = fewer_cells(start, cost, 2, 2, 1, unit=16)
    assert len(fewer.seq_slices) < 32
    assert (fewer.order, fewer.defer_wgrad, fewer.wgrad_points) == ("gpipe", True, ())
    assert all(x % 16 == 0 for x in fewer.seq_slices) and sum(fewer.seq_slices) == 4096
    per_batch = TeraPipePlan([[64, 64], [32, 96]], batch_slices=[1, 1])
    assert fewer_cells(per_batch, cost, 1, 2, 2, unit=16)[0] == per_batch
