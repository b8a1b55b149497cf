"""Edge slicing (`TeraPipePlan.edge_slices`): whole sequences, the first and last microbatches
cut into token slices.

- the plan: its checks name the field and the fix, it survives JSON, `slices_of` cuts the
  right microbatches;
- the order: the 1f1b order of a plan whose microbatches differ in cells counts sequences
  (`orders.sequences_in_flight`): with every microbatch whole it is 1F1B itself; every
  stage keeps at most K - k sequences' tokens in flight; `validate` proves every shape here
  deadlock-free, with the default W places and with W actions moved anywhere later;
- exact: every loss and every parameter gradient equal to Megatron's no-pipelining run
  (harness tolerances FP32: max-normalised 1e-5, rtol 1e-4 / atol 1e-6; losses rtol / atol
  1e-6), on 2 and 4 gloo processes, with and without deferred weight gradients, W places
  moved, Megatron's P2P, TP 2 with sequence parallelism and DDP;
- the planner's walk (planner/edge_search.py): what brute force over its bounds finds, within
  the budget.
"""

import random
from dataclasses import replace

import pytest

from harness import Case, TinyGPT, check_case, spawn
from harness.inputs.draws import w_places
from megatron_terapipe import TeraPipePlan
from megatron_terapipe.schedule import build_schedule, validate
from megatron_terapipe.schedule.orders import one_forward_one_backward

EDGES = ((1, (5, 7, 4)), (1, (8, 8)))  # first microbatch in 3 slices, last in 2


def edge_plan(edges=EDGES, **fields) -> TeraPipePlan:
    return TeraPipePlan([16], edge_slices=edges, **fields)


def test_slices_of_cuts_the_first_and_last_microbatches():
    plan = edge_plan(((2, (8, 8)), (1, (4, 12))))
    assert [plan.slices_of(m, 5) for m in range(5)] == [((8, 8),), ((8, 8),), ((16,),),
                                                         ((16,),), ((4, 12),)]
    assert [plan.cells_of(m, 5) for m in range(5)] == [2, 2, 1, 1, 2]
    assert TeraPipePlan.from_dict(plan.to_dict()) == plan
    assert "first 2 microbatches: [8, 8]; last 1 microbatches: [4, 12]" in plan.describe()
    assert edge_plan(((0, (16,)), (0, (16,)))).edge_slices == ()


@pytest.mark.parametrize("fields, message", [
    (dict(seq_slices=[8, 8]), "use seq_slices=[sequence length]"),
    (dict(order="gpipe"), "order '1f1b'"),
    (dict(virtual_stages=2), "virtual_stages=1"),
    (dict(edge_slices=((1, (8, 7)), (0, (16,)))), "sum to the sequence length 16"),
    (dict(edge_slices=((1, (8, 8)),)), "((first microbatches, [token slices])"),
])
def test_plans_it_cannot_cut_are_refused(fields, message):
    base = dict(seq_slices=[16], edge_slices=EDGES)
    with pytest.raises(ValueError, match="edge_slices") as err:
        TeraPipePlan(**{**base, **fields})
    assert message in str(err.value)


def test_cells_need_the_microbatch_count():
    from megatron_terapipe.schedule import microbatch_cells
    with pytest.raises(ValueError, match="give num_microbatches"):
        microbatch_cells(edge_plan(), 0, 1)


def test_whole_sequences_run_megatron_1f1b():
    """Every microbatch whole: the sequence-counted rule is 1F1B's warm-up and steady state."""
    from megatron_terapipe.schedule.orders import sequences_in_flight
    plan = TeraPipePlan([16])
    for M, K in [(1, 2), (3, 2), (8, 4), (5, 8)]:
        cells = build_schedule(plan, M, K, 1, forward_only=True).stages[0]
        forwards = [[f] for f in cells]
        backwards = [[replace(f, kind="B")] for f in cells]
        for k in range(K):
            assert sequences_in_flight(forwards, backwards, k, K) == \
                one_forward_one_backward(forwards, backwards, k, K)


@pytest.mark.parametrize("M, K", [(2, 2), (4, 2), (5, 4), (9, 4), (12, 8)])
def test_stages_keep_at_most_k_minus_stage_sequences(M, K):
    for edges in [EDGES, ((3, (4, 4, 4, 4)), (2, (8, 8))), ((1, (2, 14)), (0, (16,)))]:
        plan = edge_plan(edges)
        if len({plan.cells_of(m, M) for m in range(M)}) == 1:
            continue  # every microbatch cut alike: the 1f1b order of uniform plans
        schedule = build_schedule(plan, M, K, 1)
        validate(schedule)
        for k, actions in enumerate(schedule.stages):
            tokens, most = 0, 0
            for a in actions:
                if a.kind == "F":
                    tokens += a.cell.tokens
                elif a.kind == "B" and a.cell.token_slice == 0:
                    tokens -= 16
                most = max(most, tokens)
            assert most <= (K - k) * 16, (edges, M, K, k)


def test_w_places_anywhere_later_stay_deadlock_free():
    rng = random.Random(7)
    for M, K in [(3, 2), (5, 4), (8, 4)]:
        plan = edge_plan()
        for _ in range(5):
            validate(build_schedule(replace(plan, wgrad_after=w_places(rng, plan, M, K, 1)),
                                    M, K, 1))


CASES_2 = [
    Case("edge_pp2_1f1b", edge_plan(), num_microbatches=4),
    Case("edge_pp2_not_deferred", edge_plan(defer_wgrad=False), num_microbatches=3),
    Case("edge_pp2_first_only_megatron_p2p", edge_plan(((2, (4, 4, 8)), (0, (16,)))),
         num_microbatches=4, transport="megatron"),
    Case("edge_pp2_w_placed", replace(edge_plan(), wgrad_after=w_places(
        random.Random(3), edge_plan(), 4, 2, 1)), num_microbatches=4),
    Case("edge_pp2_micro_batch_2", edge_plan(), micro_batch_size=2, num_microbatches=3),
]

CASES_4 = [
    Case("edge_pp4_1f1b", edge_plan(((2, (6, 6, 4)), (2, (8, 8)))), pp=4, num_microbatches=6),
    Case("edge_tp2_pp2_sequence_parallel_ddp", edge_plan(((1, (6, 6, 4)), (1, (8, 8)))), tp=2,
         pp=2, ddp=True, num_microbatches=3, model=TinyGPT(sequence_parallel=True)),
]


def test_edge_sliced_runs_match_megatron_two_processes():
    results = spawn(2, "harness:run_cases", CASES_2, timeout=600)
    for case in CASES_2:
        check_case(results, case)


def test_edge_sliced_runs_match_megatron_four_processes():
    results = spawn(4, "harness:run_cases", CASES_4, timeout=600)
    for case in CASES_4:
        check_case(results, case)


def test_the_walk_finds_what_brute_force_finds():
    """On small questions (analytic H100 model) the planner's walk ends at the fastest of every
    edge slicing within its bounds, each with its W actions placed; and the budget holds."""
    import itertools

    from megatron_terapipe.planner import (AnalyticCostModel, ModelDims, SearchSpace,
                                           hardware_preset)
    from megatron_terapipe.planner.cost.stage_memory import MemoryBudget
    from megatron_terapipe.planner import edge_search

    dims = ModelDims(num_layers=8, hidden_size=2048, num_attention_heads=16, vocab_size=32000)
    cost = AnalyticCostModel(dims, hardware_preset("h100"), 4)
    space = SearchSpace(4096, 1, 4, 8, granularity=64, place_wgrad=True)
    plan, seconds, edges = edge_search.best_edge_plan(cost, space, MemoryBudget(None))
    timer = edge_search._Timer(cost, space, MemoryBudget(None))
    lows, highs = edge_search._bounds(space)
    every = itertools.product(*(range(lo, hi + 1) for lo, hi in zip(lows, highs)))
    assert seconds == min(timer(e)[1] for e in every)
    assert plan.edge_slices and seconds < timer((0, 2, 0, 2))[1]  # it cuts, and that pays
    budget = MemoryBudget(0.9 * max(estimate_peaks(cost, space, plan)))
    held, _, _ = edge_search.best_edge_plan(cost, space, budget)
    assert held is not None and budget.fits(estimate_peaks(cost, space, held))


def estimate_peaks(cost, space, plan):
    from megatron_terapipe.planner.evaluate.list_estimate import estimate_lists

    schedule = build_schedule(plan, space.num_microbatches, space.num_stages, 1)
    return estimate_lists(schedule, cost, with_times=False).peak_memory_bytes
