"""The budget search's list estimates (planner/evaluate/list_estimate.py) against the simulator: every
stage's peak of activations + K/V equal to `simulate`'s (the memory walk's) to the last bit,
and the busiest stage's compute equal to the walk's own sum, on random plans: both orders,
deferred weight gradients on and off, early W actions, batch slices with their own token
slices, 1 to 4 stages, and a memory model with fractional bytes and W holds, also with
Megatron's full recomputation (where every backward may rise, not only a last slice's)."""

from __future__ import annotations

import random
from typing import Optional

import pytest

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner import FunctionCostModel, simulate
from megatron_terapipe.planner.cost.recompute_time import FullRecompute
from megatron_terapipe.planner.cost.recompute_memory import RecomputedMemory
from megatron_terapipe.planner.cost.stage_memory import CostModelMemory, StageMemory
from megatron_terapipe.planner.evaluate.list_estimate import ListEstimate, _walked, estimate_lists
from megatron_terapipe.planner.evaluate.simulator import CellCosts
from megatron_terapipe.schedule import build_schedule


class OddBytes(StageMemory):
    """Fractional sizes, so that any change in the order of the sums would show."""

    layers_per_stage = 2

    def cell_bytes(self, rows, tokens, context, first, last, layers=None):
        return rows * tokens * (1.1 + 0.013 * context) * (layers if layers is not None else 2) \
            + (0.7 * rows * tokens if last else 0.0) + (0.3 if first else 0.0)

    def kv_buffer_bytes(self, rows, seq_length, layers=None):
        return 0.37 * rows * seq_length * (layers if layers is not None else 2)

    def wgrad_hold_bytes(self, rows, tokens, first, last, layers=None):
        return 0.29 * rows * tokens * (layers if layers is not None else 2) + (0.11 if last else 0)


COST = FunctionCostModel(lambda b, l, c: 1e-4 * b * (l + 0.37 * c) + 1.3e-3,
                         activation=lambda b, l, c: 1.7 * b * l + 0.01 * c,
                         kv=lambda b, l: 0.31 * b * l)


def _slices(rng: random.Random, seq: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, seq), rng.randint(0, min(5, seq - 1))))
    return [b - a for a, b in zip([0, *cuts], [*cuts, seq])]


def random_plan(rng: random.Random, stages: int, mbs: int, seq: int) -> TeraPipePlan:
    rows = [1] * mbs if mbs > 1 and rng.random() < 0.5 else None
    slices = ([_slices(rng, seq) for _ in rows] if rows and rng.random() < 0.5
              else _slices(rng, seq))
    defer = rng.random() < 0.7
    n = len(slices[0]) if isinstance(slices[0], list) else len(slices)
    points = ([sorted(rng.sample(range(n - 1), rng.randint(0, n - 1))) for _ in range(stages)]
              if defer and n > 1 and not (rows and isinstance(slices[0], list)) else ())
    return TeraPipePlan(seq_slices=slices, batch_slices=rows, order=rng.choice(["1f1b", "gpipe"]),
                        defer_wgrad=defer, wgrad_points=points)


@pytest.mark.parametrize("memory", [
    None, OddBytes(), RecomputedMemory(OddBytes(), FullRecompute("uniform", 1), 0.93),
    RecomputedMemory(OddBytes(), FullRecompute("block", 1), 0.93)],
    ids=["cost model", "odd bytes", "odd bytes, uniform recompute", "odd bytes, block recompute"])
def test_estimates_equal_the_walk_and_the_simulators_peaks(memory: Optional[StageMemory]):
    rng, checked = random.Random(7), 0
    while checked < 150:
        stages, mbs, micro = rng.randint(1, 4), rng.choice([1, 2, 3]), rng.randint(1, 5)
        try:
            plan = random_plan(rng, stages, mbs, rng.choice([7, 16, 24]))
            schedule = build_schedule(plan, micro, stages, mbs)
        except ValueError:
            continue  # a random plan the schedule refuses (e.g. early W points it cannot use)
        estimate = estimate_lists(schedule, COST, memory)
        walked = _walked(schedule, CellCosts(COST, schedule),
                         memory if memory is not None else CostModelMemory(COST))
        assert estimate == walked, plan
        peaks_only = estimate_lists(schedule, COST, memory, with_times=False)
        assert peaks_only == ListEstimate(None, estimate.peak_memory_bytes), plan
        result = simulate(schedule, COST, memory=memory)
        assert estimate.peak_memory_bytes == result.peak_memory_bytes, plan
        assert estimate.busiest_compute <= result.iteration_time * (1 + 1e-12)
        checked += 1


def test_forward_only_schedules_take_the_walk():
    plan = TeraPipePlan(seq_slices=[8, 8], order="1f1b")
    schedule = build_schedule(plan, 2, 2, 1, forward_only=True)
    estimate = estimate_lists(schedule, COST)
    assert estimate.peak_memory_bytes == simulate(schedule, COST).peak_memory_bytes
