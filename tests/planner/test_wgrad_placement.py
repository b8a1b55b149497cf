"""W placement as a planned decision (planner/wgrad_slots.py, TeraPipePlan.wgrad_after):
the builder lays W actions out where the plan says, the list scheduler never loses to the
default places, reaches the brute-force optimum of small cases, is timed by the simulator to
the bit and keeps every stage within its memory limit; the planner searches it with virtual
stages within a budget."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_terapipe import TeraPipePlan, build_schedule, validate
from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset, simulate
from megatron_terapipe.planner.cli.command import main
from megatron_terapipe.planner.cost.stage_memory import CostModelMemory, MemoryBudget
from megatron_terapipe.planner.cost.stage_memory import MemoryBudgetError
from megatron_terapipe.planner.memory_search import search_within_budget
from megatron_terapipe.planner.schedule_choice import compare_schedules
from megatron_terapipe.planner.search import SearchSpace
from megatron_terapipe.planner.evaluate.simulator import plan_time
from megatron_terapipe.planner.virtual_search import search_virtual
from megatron_terapipe.planner.wgrad_slots import POLICIES, WgradPlacer, plan_wgrad
from megatron_terapipe.schedule.build import default_places

COST = AnalyticCostModel(model_preset("gpt3-1b"), hardware_preset("a100"), layers_per_stage=6,
                         tensor_parallel=2)


def test_the_builder_puts_w_actions_where_the_plan_says():
    plan = TeraPipePlan([512, 512], order="gpipe")
    schedule = build_schedule(plan, 2, 2, 1)
    assert default_places(schedule.stages[0]) == [6, 8]  # F F F F B B W B B W
    moved = build_schedule(replace(plan, wgrad_after=[[7, 8], [8, 8]]), 2, 2, 1)
    assert [str(a) for a in moved.stages[1]][4:] == ["B(m1b0t1)", "B(m1b0t0)", "B(m0b0t1)",
                                                    "B(m0b0t0)", "W(m1b0t0)", "W(m0b0t0)"]
    assert [str(a) for a in moved.stages[0]][4:8] == ["B(m1b0t1)", "B(m1b0t0)", "B(m0b0t1)",
                                                     "W(m1b0t0)"]
    validate(moved)
    for places, message in [([[5, 8]], "must run after its backward"),
                            ([[6, 9]], "within the stage's 8"), ([[6]], "places 1 W actions")]:
        with pytest.raises(ValueError, match=message):
            build_schedule(replace(plan, wgrad_after=places), 2, 2, 1)


def test_a_deferred_w_keeps_what_it_needs_until_it_runs():
    """One stage, gpipe, two sequences: with both W actions at the end, the stage holds both
    sequences' W inputs after the last backward (the cells' activations and K/V gone)."""
    plan = TeraPipePlan([1024], order="gpipe")
    memory = CostModelMemory(COST)
    late = simulate(build_schedule(replace(plan, wgrad_after=[[4, 4]]), 2, 1, 2), COST)
    early = simulate(build_schedule(plan, 2, 1, 2), COST)
    hold = memory.wgrad_hold_bytes(2, 1024, True, True)
    after_backwards = late.memory[0][-3]  # then the two W actions free it
    assert after_backwards.activation_bytes == pytest.approx(2 * hold)
    assert after_backwards.kv_bytes == pytest.approx(0.0)
    assert late.memory[0][-1].activation_bytes == pytest.approx(0.0)
    assert max(late.peak_memory_bytes) >= max(early.peak_memory_bytes)


@pytest.mark.parametrize("K,M,T,V,order", [(2, 2, 2, 1, "1f1b"), (3, 2, 1, 1, "1f1b"),
                                           (2, 1, 3, 2, "1f1b"), (2, 2, 1, 2, "gpipe")])
def test_placement_reaches_the_brute_force_optimum_of_small_cases(K, M, T, V, order):
    plan = replace(TeraPipePlan.uniform(1024, T, order=order, multiple_of=64), virtual_stages=V)
    schedule = build_schedule(plan, M, K, 2)
    counts = [sum(a.kind != "W" for a in actions) for actions in schedule.stages]

    def places(k):  # every non-decreasing placement of stage k's W actions
        earliest = default_places(schedule.stages[k])
        for combo in itertools.combinations_with_replacement(range(counts[k] + 1), len(earliest)):
            if all(p >= e for p, e in zip(combo, earliest)):
                yield combo

    best = min(plan_time(replace(plan, wgrad_after=list(c)), COST, M, K, 2)
               for c in itertools.product(*(list(places(k)) for k in range(K))))
    placed, time = plan_wgrad(plan, COST, M, K, 2)
    assert time == pytest.approx(best, rel=1e-12) and time < plan_time(plan, COST, M, K, 2)


plans = st.builds(
    lambda slices, batch, order, V: TeraPipePlan(
        [s * 64 for s in slices] if batch is None else [[s * 64 for s in slices]] * len(batch),
        batch_slices=batch, order=order, virtual_stages=V),
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.one_of(st.none(), st.just([1, 1])), st.sampled_from(["1f1b", "gpipe"]),
    st.sampled_from([1, 2, 3]))


@settings(max_examples=40, deadline=None)
@given(plan=plans, M=st.integers(1, 4), K=st.integers(2, 4), squeeze=st.floats(0.5, 1.5))
def test_placement_is_never_slower_is_timed_exactly_and_keeps_the_limits(plan, M, K, squeeze):
    """Every policy's places: the simulator times the placed plan exactly as the list
    scheduler did; no stage's peak passes its limit (or the default's peak, where that is
    higher); plan_wgrad is never slower than the default places."""
    rows = 2
    schedule = build_schedule(plan, M, K, rows)
    default = simulate(schedule, COST)
    limits = [p * squeeze for p in default.peak_memory_bytes]
    placer = WgradPlacer(schedule, COST)
    for policy in POLICIES:
        places, time = placer.place(policy, limits)
        placed = simulate(build_schedule(replace(plan, wgrad_after=places), M, K, rows), COST)
        assert placed.iteration_time == time
        for k, peak in enumerate(placed.peak_memory_bytes):
            assert peak <= max(limits[k], default.peak_memory_bytes[k]) * (1 + 1e-12)
    budget = MemoryBudget(max(limits) + 1.0)
    best, time = plan_wgrad(plan, COST, M, K, rows, budget)
    assert time <= default.iteration_time
    assert time == plan_time(best, COST, M, K, rows)


BIG = AnalyticCostModel(model_preset("gpt3-13b"), hardware_preset("h100"), layers_per_stage=5,
                        tensor_parallel=8, inter_node=True)


def test_planner_chooses_chunks_slices_and_w_places_within_the_budget():
    """gpt3-13b on 8 H100 stages (TP 8), 8 microbatches of one 8192-token sequence: within
    20 GiB, 5 chunks per stage with W places beat one chunk and Megatron's schedules."""
    space = SearchSpace(8192, 1, 8, 8, virtual_stages=(5,), place_wgrad=True)
    budget = MemoryBudget(20 * 2 ** 30, (3.84 * 2 ** 30,) + (3.3 * 2 ** 30,) * 6 + (3.84 * 2 ** 30,))
    one = search_within_budget(BIG, space, budget)
    assert one.plan.wgrad_after and one.steps[-1] is one.chosen
    assert one.chosen.time < plan_time(replace(one.plan, wgrad_after=()), BIG, 8, 8, 1)
    chunked = search_virtual(BIG, space, budget, 5, one.plan)
    assert chunked.plan.virtual_stages == 5 and budget.fits(chunked.chosen.result.peak_memory_bytes)
    assert chunked.chosen.time < one.chosen.time
    assert chunked.chosen.time <= min(t for _, t in chunked.timed)
    table = compare_schedules(BIG, space, budget, 5, search=lambda order: one)
    assert table.auto().chosen.name == "TeraPipe 1f1b, 5 chunks"
    with pytest.raises(MemoryBudgetError, match="on 5 chunks per stage fits") as error:
        search_virtual(BIG, space, MemoryBudget(4 * 2 ** 30, budget.model_state), 5)
    assert error.value.leanest.plan.virtual_stages == 5


def test_chunk_counts_must_divide_a_stage_s_layers(capsys):
    base = ["--model", "gpt3-1b", "--pipeline-stages", "4", "--seq-length", "1024",
            "--granularity", "64", "--num-microbatches", "4"]
    with pytest.raises(SystemExit):
        main(base + ["--virtual-stages", "4"])
    assert "--virtual-stages" in capsys.readouterr().err
    assert main(base + ["--virtual-stages", "1,3", "--wgrad-placement", "off"]) == 0
    rows = [line for line in capsys.readouterr().out.split("schedules, best first")[1]
            .splitlines() if line.startswith("  TeraPipe")]
    assert len(rows) == 4  # each order on 1 and 3 chunks
    assert sum(", 3 chunks" in r for r in rows) == 2 and not any("2 chunks" in r for r in rows)


def test_schedule_files_keep_chunks_and_w_places(tmp_path):
    from megatron_terapipe.schedule import dump_schedule, load_schedule

    plan = TeraPipePlan([4, 4], virtual_stages=2, wgrad_after=[[16] * 4, [16] * 4])
    schedule = build_schedule(plan, 2, 2, 1)
    path = dump_schedule(schedule, tmp_path / "schedule.json")
    assert '"F(m0b0t1c1)"' in path.read_text()
    again = load_schedule(path)
    assert again.plan == plan and again.stages == schedule.stages
    assert [a.kind for a in again.stages[0][-4:]] == ["W"] * 4
