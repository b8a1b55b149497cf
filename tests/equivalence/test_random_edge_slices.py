"""Random edge-sliced plans: whole sequences with the first and last microbatches cut.

test_edge_slices.py runs seven hand-picked shapes of `TeraPipePlan.edge_slices`; here a seeded
`random.Random` (the same draws every run) draws any number of first and last microbatches
(they may overlap or cover every microbatch), any slicing of each, deferred weight gradients or
not, W actions at random places at or after their backwards, and any microbatch count:
- 300 draws on 2 to 4 stages: each schedule passes `validate` (deadlock-free) and the
  simulator times every one of its actions;
- some run on 2 processes (PP=2: DDP, deallocated outputs, Megatron's P2P, micro batch 1 or
  2) and on 4 (PP=4, or TP=2 x PP=2 with and without sequence parallelism), every parameter
  gradient and every reported loss equal to Megatron's no-pipelining run on the full model at
  the equivalence suite's fp32 tolerances (harness.compare.FP32: max-normalised 1e-5, rtol 1e-4
  / atol 1e-6; losses rtol / atol 1e-6).
TERAPIPE_RANDOM_SEED and TERAPIPE_RANDOM_RUNS draw other or more runs (docs/testing.md).
"""

from __future__ import annotations

import random

import pytest

from harness import Case, TinyGPT, check_case
from harness.inputs.draws import COST, RUNS, SEED, draw_edge_plan, random_cases
from megatron_terapipe import build_schedule, validate
from megatron_terapipe.planner import simulate


def _case(rng: random.Random, name: str, world: int) -> Case:
    M, rows = rng.randint(1, 6), rng.choice([1, 2])
    if world == 2:
        shape = dict(pp=2, model=TinyGPT(num_layers=rng.choice([2, 4, 6])),
                     ddp=rng.random() < 0.3, deallocate_outputs=rng.random() < 0.3,
                     transport=rng.choice([None, "megatron"]))
    elif rng.random() < 0.5:
        shape = dict(pp=4, model=TinyGPT(num_layers=rng.choice([4, 8])), ddp=rng.random() < 0.3)
    else:
        parallel = rng.random() < 0.5
        shape = dict(pp=2, tp=2, model=TinyGPT(sequence_parallel=parallel),
                     ddp=parallel or rng.random() < 0.3)
    multiple = 2 if shape["model"].sequence_parallel else 1
    plan = draw_edge_plan(rng, shape["pp"], M, rows, multiple)
    return Case(name, plan, num_microbatches=M, micro_batch_size=rows, **shape)


CASES_2 = random_cases(_case, 2, max(1, RUNS // 2), SEED, stream=100, prefix="random_edges")
CASES_4 = random_cases(_case, 4, max(1, RUNS // 3), SEED, stream=100, prefix="random_edges")


def test_random_edge_plans_validate_and_simulate():
    """Many more draws than run: every schedule is deadlock-free, the simulator (which replays
    the same action lists) times every action, and the cut microbatches are the drawn ones."""
    rng = random.Random(SEED)
    for _ in range(300):
        K, M, rows = rng.choice([2, 3, 4]), rng.randint(1, 9), rng.choice([1, 2])
        plan = draw_edge_plan(rng, K, M, rows)
        schedule = build_schedule(plan, M, K, rows)
        validate(schedule)
        result = simulate(schedule, COST)
        assert len(result.timeline) == sum(map(len, schedule.stages)), plan
        forwards = [a for a in schedule.stages[0] if a.kind == "F"]
        assert len(forwards) == sum(plan.cells_of(m, M) for m in range(M)), plan


#: What the world2 / world4 fixtures run (conftest.py): WORKER on each world's cases.
WORKER = "harness:run_cases"
WORLDS = {2: CASES_2, 4: CASES_4}


@pytest.mark.parametrize("case", CASES_2, ids=[c.name for c in CASES_2])
def test_random_edge_plans_on_two_processes(world2, case):
    check_case(world2, case)


@pytest.mark.parametrize("case", CASES_4, ids=[c.name for c in CASES_4])
def test_random_edge_plans_on_four_processes(world4, case):
    check_case(world4, case)
