"""Random draws for the seeded random-plan tests (tests/equivalence/test_random_*.py,
tests/plan/): the seed and run count, compositions of a sequence, W places and edge-sliced plans.

A seeded `random.Random` draws the same every run; TERAPIPE_RANDOM_SEED and
TERAPIPE_RANDOM_RUNS draw other or more runs (docs/testing.md)."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from typing import Callable

from megatron_terapipe import TeraPipePlan, build_schedule
from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset
from megatron_terapipe.schedule.build import default_places
from ..models import TinyGPT

SEED = int(os.environ.get("TERAPIPE_RANDOM_SEED", "2026"))
RUNS = int(os.environ.get("TERAPIPE_RANDOM_RUNS", "12"))
SEQ = TinyGPT().seq_length
#: What the draws' schedules are simulated on.
COST = AnalyticCostModel(model_preset("gpt3-1b"), hardware_preset("a100"), layers_per_stage=4,
                         tensor_parallel=2)


def random_cases(draw_case: Callable, world: int, count: int, seed: int, *, stream: int,
                 prefix: str) -> list:
    """`count` cases for `world` processes, drawn by `draw_case(rng, name, world)` from one
    seeded stream (`seed * stream + world`: each file its own `stream`, so that draws stay apart)
    and named `<prefix>_<world>_<seed>_<i>`."""
    rng = random.Random(seed * stream + world)
    return [draw_case(rng, f"{prefix}_{world}_{seed}_{i}", world) for i in range(count)]


def composition(rng: random.Random, total: int, parts: int) -> list[int]:
    """`total` cut into `parts` positive parts at random."""
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def w_places(rng: random.Random, plan: TeraPipePlan, M: int, K: int, rows: int) -> list[list[int]]:
    """Per stage, non-decreasing places at or after each W's default (its backward), half of
    them moved to a random later place."""
    out = []
    for actions in build_schedule(plan, M, K, rows).stages:
        compute = sum(a.kind != "W" for a in actions)
        places, last = [], 0
        for least in default_places(actions):
            last = max(last, rng.randint(least, compute) if rng.random() < 0.5 else least)
            places.append(last)
        out.append(places)
    return out


def _slicing(rng: random.Random, multiple: int) -> tuple[int, ...]:
    units = SEQ // multiple
    return tuple(u * multiple for u in composition(rng, units, rng.randint(1, min(4, units))))


def draw_edge_plan(rng: random.Random, K: int, M: int, rows: int,
                   multiple: int = 1) -> TeraPipePlan:
    """A random edge-sliced plan for M microbatches of `rows` rows on K stages."""
    first = rng.randint(0, min(3, M))
    last = rng.randint(0 if first else 1, min(3, M))
    plan = TeraPipePlan([SEQ], defer_wgrad=rng.random() < 0.8,
                        edge_slices=((first, _slicing(rng, multiple)),
                                     (last, _slicing(rng, multiple))))
    if plan.defer_wgrad and rng.random() < 0.5:
        plan = replace(plan, wgrad_after=w_places(rng, plan, M, K, rows))
    return plan
