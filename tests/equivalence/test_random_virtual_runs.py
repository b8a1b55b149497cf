"""Random plans on virtual stages, with W actions anywhere after their backwards.

The planner's W places and the hand-picked cases of test_virtual_runs.py are a few points of a
large space: any slicing, order, chunk count, group size, second warm-up term, early W points
and any non-decreasing W places at or after each W's backward (`TeraPipePlan.wgrad_after`)
make a plan the builder accepts. Here such plans are drawn at random (a seeded
`random.Random`, so every run draws the same):
- each one's schedule passes `validate` (deadlock-free) and the simulator times it;
- some put their 2 chunks in a V (virtual_placement "v", a lead of 0 to 2 units), drawn apart
  so that the ring's draws stay as they were, on layer counts the V's chunks halve, and on 4
  processes always one with sequence parallelism (TP=2 x PP=2);
- some run on 2 processes (PP=2, V up to 4, DDP, deallocated outputs) and on 4 (PP=4 x V=2
  with either transport, or TP=2 x PP=2 with and without sequence parallelism), with every
  parameter gradient and every reported loss equal to Megatron's no-pipelining run on the
  full model at the equivalence suite's fp32 tolerances (harness.compare.FP32), as
  test_virtual_runs.py checks its cases.
TERAPIPE_RANDOM_SEED and TERAPIPE_RANDOM_RUNS draw other or more runs (docs/tests.md).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Optional

import pytest

from harness import TinyGPT, check_case
from harness.inputs.draws import COST, RUNS, SEED, SEQ, composition, random_cases, w_places
from harness.runs.virtual_runs import VirtualCase
from megatron_terapipe import TeraPipePlan, build_schedule, validate
from megatron_terapipe.planner import simulate
from megatron_terapipe.schedule.build import allowed_group


def draw_plan(rng: random.Random, K: int, V: int, tp_multiple: int = 1,
              v_shape: bool = False) -> tuple[TeraPipePlan, int, int]:
    """(plan, microbatches, micro batch size): a random plan on K stages x V chunks (`v_shape`:
    2 chunks in a V, whose warm-up is a lead of 0 to 2 units and which has no groups)."""
    order = rng.choice(["1f1b", "gpipe"])
    defer = rng.random() < 0.85
    units = composition(rng, SEQ // tp_multiple, rng.randint(1, 4))
    M, rows = rng.randint(1, 7), rng.choice([1, 2])
    batch = [1, 1] if rows == 2 and rng.random() < 0.3 else None
    plan = TeraPipePlan([u * tp_multiple for u in units], batch_slices=batch, order=order,
                        defer_wgrad=defer, virtual_stages=V,
                        virtual_placement="v" if v_shape else "ring")
    groups = [g for g in range(1, M + 1) if allowed_group(g, M, K, plan.num_cells)]
    points = ()
    if defer and len(units) > 1 and rng.random() < 0.3:
        points = tuple(tuple(sorted(rng.sample(range(1, len(units)),
                                               rng.randint(0, len(units) - 1))))
                       for _ in range(K))
    leads = [None, 0, 1, 2] if v_shape else [None, None, 0, 1]
    plan = replace(plan, virtual_group=None if v_shape else rng.choice(groups + [None]),
                   wgrad_points=points,
                   virtual_warmup=rng.choice(leads) if order == "1f1b" else None)
    if defer and rng.random() < 0.8:
        plan = replace(plan, wgrad_after=w_places(rng, plan, M, K, rows))
    return plan, M, rows


def _shape(rng: random.Random, world: int, v_shape: bool) -> dict:
    if world == 2:
        # a V's 2 chunks halve each stage's layers: 2 or 4 per stage, not 3
        layers = rng.choice([4, 8] if v_shape else [4, 6, 8])
        return dict(pp=2, model=TinyGPT(num_layers=layers), ddp=rng.random() < 0.3,
                    deallocate_outputs=rng.random() < 0.3)
    if rng.random() < 0.5:
        return dict(pp=4, model=TinyGPT(num_layers=8), ddp=rng.random() < 0.3,
                    transport=rng.choice([None, "megatron"]))
    parallel = rng.random() < 0.5
    return dict(pp=2, tp=2, model=TinyGPT(num_layers=4, sequence_parallel=parallel),
                ddp=parallel or rng.random() < 0.3)


def _case(rng: random.Random, name: str, world: int, v_shape: bool = False,
          shape: Optional[dict] = None) -> VirtualCase:
    shape = dict(shape or _shape(rng, world, v_shape))
    layers = shape["model"].num_layers // shape["pp"]
    V = 2 if v_shape else rng.choice([v for v in (2, 3, 4) if layers % v == 0])
    assert layers % V == 0, f"{name}: {layers} layers per stage on {V} chunks"
    tp_multiple = 2 if shape["model"].sequence_parallel else 1
    if v_shape:
        shape["transport"] = None  # Megatron's communicator does not carry a V's routes
    plan, M, rows = draw_plan(rng, shape["pp"], V, tp_multiple, v_shape)
    if shape.get("transport") == "megatron" and plan.batch_slices:
        shape["transport"] = None  # Megatron's communicator: one message shape per channel
    return VirtualCase(name, plan, num_microbatches=M, micro_batch_size=rows, **shape)


def random_v_shape_cases(world: int, count: int, seed: int) -> list[VirtualCase]:
    """Chunks in a V, drawn apart from the ring's cases (which stay the same draws); on 4
    processes also one V with sequence parallelism (TP=2 x PP=2), which other draws may miss."""
    rng = random.Random(seed * 10 + world + 5)
    cases = [_case(rng, f"random_in_a_v_{world}_{seed}_{i}", world, v_shape=True)
             for i in range(count)]
    if world == 4:
        parallel = dict(pp=2, tp=2, model=TinyGPT(num_layers=4, sequence_parallel=True), ddp=True)
        rng = random.Random(seed * 10 + 8)  # a stream of its own (2, 4, 7 and 9 are taken)
        cases.append(_case(rng, f"random_in_a_v_sequence_parallel_{seed}", world, v_shape=True,
                           shape=parallel))
    return cases


CASES_2 = (random_cases(_case, 2, RUNS, SEED, stream=10, prefix="random_v")
           + random_v_shape_cases(2, max(1, RUNS // 3), SEED))
CASES_4 = (random_cases(_case, 4, max(1, RUNS * 2 // 3), SEED, stream=10, prefix="random_v")
           + random_v_shape_cases(4, max(1, RUNS // 6), SEED))


def test_random_plans_validate_and_simulate():
    """Many more draws than run: every schedule is deadlock-free and the simulator (which
    replays the same action lists) finishes it with every action timed."""
    rng = random.Random(SEED)
    for _ in range(300):
        K = rng.choice([2, 3, 4])
        V = rng.choice([2, 4])
        plan, M, rows = draw_plan(rng, K, V, v_shape=V == 2 and rng.random() < 0.3)
        schedule = build_schedule(plan, M, K, rows)
        validate(schedule)
        result = simulate(schedule, COST)
        assert result.iteration_time > 0
        assert len(result.timeline) == sum(map(len, schedule.stages)), plan


#: What the world2 / world4 fixtures run (conftest.py): WORKER on each world's cases.
WORKER = "harness.runs.virtual_runs:run_virtual_cases"
WORLDS = {2: CASES_2, 4: CASES_4}


@pytest.mark.parametrize("case", CASES_2, ids=[c.name for c in CASES_2])
def test_random_plans_on_two_processes(world2, case):
    check_case(world2, case)


@pytest.mark.parametrize("case", CASES_4, ids=[c.name for c in CASES_4])
def test_random_plans_on_four_processes(world4, case):
    check_case(world4, case)
