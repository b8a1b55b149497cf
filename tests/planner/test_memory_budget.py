"""The plan search under a memory budget (planner/memory_search.py): the plan it returns fits,
it is the fastest fitting plan among those it could return, and no fit is a clear error."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_terapipe.planner import AnalyticCostModel, FunctionCostModel, hardware_preset, model_preset
from megatron_terapipe.planner.cost.stage_memory import (GiB, MemoryBudget, MemoryBudgetError,
                                              ModelStateConfig, model_state_bytes)
from megatron_terapipe.planner.memory_search import leaner_candidates, search_within_budget
from megatron_terapipe.planner.search import SearchSpace, search


def cost_model():
    """Per-cell overhead makes few slices fast; activations of 1 byte per row and token."""
    return FunctionCostModel(lambda b, l, c: 1e-3 * b * (l + 0.5 * c) / 64 + 2e-3,
                             activation=lambda b, l, c: b * l * 1.0 + 0 * c,
                             kv=lambda b, l: 0.25 * b * l)


SPACE = SearchSpace(seq_length=512, micro_batch_size=4, num_stages=4, num_microbatches=4,
                    order="1f1b", granularity=32, defer_wgrad=False)


def test_unconstrained_plan_stands_when_it_fits():
    free = search(cost_model(), SPACE)
    peak = max(free.chosen.result.peak_memory_bytes)
    within = search_within_budget(cost_model(), SPACE, MemoryBudget(peak * 1.01))
    assert within.plan == free.plan


@pytest.mark.parametrize("share", [0.9, 0.5, 0.1])
def test_tighter_budgets_are_honoured_at_the_fastest_fitting_plan(share):
    """Budgets between the leanest plan's peak and the unconstrained plan's: the plan fits
    and no candidate that fits is faster."""
    cost = cost_model()
    free = max(search(cost, SPACE).chosen.result.peak_memory_bytes)
    candidates = leaner_candidates(cost, SPACE)
    leanest = min(max(c.result.peak_memory_bytes) for c in candidates)
    assert leanest < 0.8 * free  # there is room to trade speed for memory
    budget = MemoryBudget(leanest + share * (free - leanest))
    found = search_within_budget(cost, SPACE, budget)
    assert budget.fits(found.chosen.result.peak_memory_bytes)
    fitting = [c for c in candidates if budget.fits(c.result.peak_memory_bytes)]
    assert found.chosen.time <= min(c.time for c in fitting) + 1e-12
    assert found.plan.predicted_time == pytest.approx(found.chosen.time)


def test_model_state_counts_against_the_budget():
    cost = cost_model()
    free = search(cost, SPACE)
    peak = max(free.chosen.result.peak_memory_bytes)
    assert search_within_budget(cost, SPACE, MemoryBudget(peak * 1.01, (0.0,))).plan == free.plan
    shifted = search_within_budget(cost, SPACE, MemoryBudget(peak * 1.01, (0.2 * peak,)))
    assert shifted.plan != free.plan
    assert max(shifted.chosen.result.peak_memory_bytes) <= 0.81 * peak


def test_no_fit_names_the_budget_and_the_fixes():
    with pytest.raises(MemoryBudgetError, match=r"no gpipe plan fits the memory budget of 1 B "
                                                r"per GPU: the leanest .* peaks at 10.0 KiB on "
                                                r"stage 0.*order 1f1b"):
        search_within_budget(cost_model(), SearchSpace(512, 4, 4, 4, "gpipe", 32, defer_wgrad=False),
                             MemoryBudget(1.0))


def test_gpt3_13b_on_a100s_within_40_gib():
    """A budget between the 1f1b plan's peak and the unconstrained gpipe plan's: gpipe has no
    plan that fits; 1f1b does, within Megatron's own accounting of the model state."""
    model = model_preset("gpt3-13b")
    cost = AnalyticCostModel(model, hardware_preset("a100"), layers_per_stage=5)
    state = model_state_bytes(model, 5, 8, ModelStateConfig(data_parallel=8, distributed_optimizer=True))
    budget = MemoryBudget(20 * GiB, state)
    space = SearchSpace(2048, 1, 8, 8, "1f1b", 16)
    found = search_within_budget(cost, space, budget)
    assert max(budget.totals(found.chosen.result.peak_memory_bytes)) <= 20 * GiB
    with pytest.raises(MemoryBudgetError):
        search_within_budget(cost, SearchSpace(2048, 1, 8, 8, "gpipe", 16), budget)
    assert np.isfinite(found.plan.predicted_time)


def _reference(candidates, budget):
    """Timing every plan: the fastest that fits (the first of equals), else the leanest."""
    fitting = [c for c in candidates if budget.fits(c.result.peak_memory_bytes)]
    if fitting:
        return min(fitting, key=lambda c: c.time), None
    return None, min(candidates, key=lambda c: max(budget.totals(c.result.peak_memory_bytes)))


@pytest.mark.parametrize("order, defer", [("1f1b", False), ("gpipe", True), ("1f1b", None)])
def test_fastest_leaner_times_fewer_plans_and_chooses_as_timing_every_one(order, defer):
    """The list estimates give every plan's simulated peaks exactly and a lower bound of its
    time, and the compute floor a lower bound of that, so skipping plans changes nothing: the same plan as timing all of them, for budgets
    from nothing fitting to everything fitting."""
    from megatron_terapipe.planner.memory_search import compute_floor, fastest_leaner, leaner_plans
    from megatron_terapipe.planner.evaluate.list_estimate import estimate_lists
    from megatron_terapipe.schedule import build_schedule

    cost = cost_model()
    space = SearchSpace(seq_length=512, micro_batch_size=4, num_stages=4, num_microbatches=4,
                        order=order, granularity=32, defer_wgrad=defer)
    candidates = leaner_candidates(cost, space)
    assert [c.plan for c in candidates] == [plan for _, plan in leaner_plans(space)]
    for c in candidates:
        schedule = build_schedule(c.plan, 4, 4, 4)
        estimate = estimate_lists(schedule, cost)
        assert estimate.peak_memory_bytes == c.result.peak_memory_bytes
        assert estimate.busiest_compute <= c.time + 1e-12
        assert compute_floor(cost, space, c.plan) <= estimate.busiest_compute
    peaks = sorted(max(c.result.peak_memory_bytes) for c in candidates)
    for budget in (MemoryBudget(peaks[0] * 0.99), *(MemoryBudget(p) for p in peaks)):
        best, leanest = fastest_leaner(cost, space, budget)
        ref_best, ref_leanest = _reference(candidates, budget)
        assert (best and (best.name, best.plan)) == (ref_best and (ref_best.name, ref_best.plan))
        assert (leanest and leanest.plan) == (ref_leanest and ref_leanest.plan)


def test_each_plan_is_one_row_of_the_table(capsys):
    """Under a budget the search's steps start from plans the table already lists (gpt3-13b,
    32 microbatches, 20 GiB: the unbudgeted choice and the leaner uniform plan): each plan
    gets one row."""
    from megatron_terapipe.planner.cli.command import main

    main(["--model", "gpt3-13b", "--hardware", "h100", "--pipeline-stages", "8",
          "--tensor-parallel-size", "8", "--seq-length", "8192", "--micro-batch-size", "1",
          "--num-microbatches", "32", "--memory-budget", "20GiB", "--virtual-stages", "1",
          "--wgrad-placement", "off"])
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if "peak GiB/stage" in line) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("peak GiB per stage"))
    labels = [line[:24].strip() for line in lines[start:end]]
    assert len(labels) >= 3 and labels[-1] == "no token slicing", labels
    assert len(set(labels)) == len(labels), labels
