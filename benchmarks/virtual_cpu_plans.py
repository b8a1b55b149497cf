"""The TeraPipe plans bench_virtual_cpu.py times on virtual stages, each from the planner on
the profiled cost model (no memory budget: these models are far from the host's memory)."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from harness import TinyGPT
from megatron_terapipe.plan import TeraPipePlan

GRANULARITY = 64  # the slicing unit of every plan here


def _space(model: TinyGPT, M: int, stages: int, order: str = "1f1b", **kwargs):
    from megatron_terapipe.planner import SearchSpace

    return SearchSpace(model.seq_length, 1, stages, M, order=order, granularity=GRANULARITY,
                       **kwargs)


def virtual_plan(cost, model: TinyGPT, M: int, hint: TeraPipePlan, stages: int, chunks: int,
                 placement: str = "ring"):
    """The planner's plan on `chunks` chunks per stage (`placement` "v": in a V), the faster
    of its two orders, and every plan its searches timed."""
    from megatron_terapipe.planner import search_virtual
    from megatron_terapipe.planner.cost.stage_memory import MemoryBudget

    best, timed = None, {}
    for order in ("1f1b", "gpipe"):
        space = _space(model, M, stages, order, defer_wgrad=None, place_wgrad=True)
        found = search_virtual(cost, space, MemoryBudget(None), chunks, hint, placement)
        timed[order] = [[name, seconds] for name, seconds in found.timed]
        if best is None or found.plan.predicted_time < best.predicted_time:
            best = found.plan
    return best, timed


def v_shape_plan(cost, model: TinyGPT, M: int, stages: int) -> TeraPipePlan:
    """The planner's plan on 2 chunks per stage in a V (Zero Bubble's ZB-V placement)."""
    return virtual_plan(cost, model, M, None, stages, 2, placement="v")[0]


def uniform_virtual_plan(cost, model: TinyGPT, M: int, like: TeraPipePlan, stages: int,
                         chunks: int) -> TeraPipePlan:
    """The best near-equal slicing on `chunks` chunks in `like`'s order and W mode, with
    Megatron's default group and warm-up and W actions in their default places."""
    from megatron_terapipe.planner import plan_time

    unit = _space(model, 1, stages).unit
    cache: dict = {}
    best = None
    for n in range(1, model.seq_length // unit + 1):
        plan = replace(TeraPipePlan.uniform(model.seq_length, n, like.order, unit),
                       virtual_stages=chunks, defer_wgrad=like.defer_wgrad)
        try:
            seconds = plan_time(plan, cost, M, stages, 1, cache=cache)
        except ValueError:  # a slice count this order cannot group on this many stages
            continue
        if best is None or seconds < best.predicted_time:
            best = replace(plan, predicted_time=seconds)
    return best


def edge_plan(cost, model: TinyGPT, M: int, stages: int) -> Optional[TeraPipePlan]:
    """The edge walk's plan on one chunk, W placed (no budget); None below 2K microbatches."""
    from megatron_terapipe.planner.cost.stage_memory import MemoryBudget
    from megatron_terapipe.planner.edge_search import applies, best_edge_plan

    space = _space(model, M, stages, place_wgrad=True)
    if not applies(space):
        return None
    plan, seconds, _ = best_edge_plan(cost, space, MemoryBudget(None))
    return replace(plan, predicted_time=seconds)
