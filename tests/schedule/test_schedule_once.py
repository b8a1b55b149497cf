"""The schedule is built, validated and lowered once per plan and batch shape (kept with the
plan's memory), and orders come from one registry (schedule/orders.py)."""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_terapipe import TeraPipePlan
from megatron_terapipe.megatron.args.flags import add_terapipe_args
from megatron_terapipe.megatron.hooks import forward_backward
from megatron_terapipe.plan import ORDERS as PLAN_ORDERS
from megatron_terapipe.schedule import (
    ORDERS, Lowering, ScheduleError, build_lowered_schedule, build_schedule, lower, validate)

GLOO = Lowering(post_receives_early=True)
MEGATRON = Lowering(fuse_send_recv=True)


def all_forwards_then_backwards_by_microbatch(forwards, backwards, stage, num_stages):
    """A new order for the tests: every forward, then the backwards microbatch by microbatch
    (each microbatch's cells in reverse)."""
    return ([f for cells in forwards for f in cells]
            + [b for cells in backwards for b in reversed(cells)])


def backwards_first(forwards, backwards, stage, num_stages):
    """A broken order: backwards before their forwards."""
    return ([b for cells in backwards for b in reversed(cells)]
            + [f for cells in forwards for f in cells])


def test_the_registry_is_the_one_list_of_orders():
    assert tuple(ORDERS) == PLAN_ORDERS == ("1f1b", "gpipe")
    parser = add_terapipe_args(argparse.ArgumentParser())
    assert parser.parse_args(["--terapipe-order", "gpipe"]).terapipe_order == "gpipe"
    with pytest.raises(SystemExit):
        parser.parse_args(["--terapipe-order", "zigzag"])


def test_a_new_order_is_one_function_and_one_entry(monkeypatch):
    with pytest.raises(ValueError, match="order must be one of"):
        TeraPipePlan([4, 4], order="by-microbatch")
    monkeypatch.setitem(ORDERS, "by-microbatch", all_forwards_then_backwards_by_microbatch)
    plan = TeraPipePlan([4, 4], order="by-microbatch")  # the plan's check reads the registry
    parser = add_terapipe_args(argparse.ArgumentParser())
    assert parser.parse_args(["--terapipe-order", "by-microbatch"]).terapipe_order == "by-microbatch"
    schedule = build_schedule(plan, 2, 3, 1)
    validate(schedule)
    backwards = [str(a) for a in schedule.stages[2] if a.kind == "B"]
    assert backwards == ["B(m0b0t1)", "B(m0b0t0)", "B(m1b0t1)", "B(m1b0t0)"]
    assert [str(a) for a in schedule.stages[2][:4]] == [
        "F(m0b0t0)", "F(m0b0t1)", "F(m1b0t0)", "F(m1b0t1)"]


def test_the_registered_orders_build_what_they_built_before():
    """1f1b's warm-up and gpipe's reverse, written out for 2 cells, 2 microbatches, 2 stages."""
    one_f_one_b = build_schedule(TeraPipePlan([4, 4], defer_wgrad=False), 2, 2, 1)
    assert [str(a) for a in one_f_one_b.stages[0]] == [
        "F(m0b0t0)", "F(m0b0t1)", "F(m1b0t0)", "B(m0b0t1)", "F(m1b0t1)", "B(m0b0t0)",
        "B(m1b0t1)", "B(m1b0t0)"]
    gpipe = build_schedule(TeraPipePlan([4, 4], order="gpipe", defer_wgrad=False), 2, 2, 1)
    assert [str(a) for a in gpipe.stages[1]] == [
        "F(m0b0t0)", "F(m0b0t1)", "F(m1b0t0)", "F(m1b0t1)", "B(m1b0t1)", "B(m1b0t0)",
        "B(m0b0t1)", "B(m0b0t0)"]


def test_a_lowered_schedule_is_validated_where_it_is_built(monkeypatch):
    lowered = build_lowered_schedule(TeraPipePlan([4, 4]), 2, 3, 1, lowering=GLOO)
    assert lowered.stages == lower(lowered.schedule, GLOO) and lowered.num_stages == 3
    monkeypatch.setitem(ORDERS, "backwards-first", backwards_first)
    with pytest.raises(ScheduleError, match="stage 0 runs B.* before its forward") as error:
        build_lowered_schedule(TeraPipePlan([4, 4], order="backwards-first"), 2, 3, 1)
    assert ">>B(m0b0t1)<<" in error.value.grid


def plan_memory(model, plan, lowering=GLOO, stages=2, forward_only=False):
    config = SimpleNamespace(terapipe_cuda_graphs=False)
    return forward_backward.plan_memory(model, config, torch.device("cpu"), plan, 4, stages, 1,
                                        forward_only, lowering)


def test_the_plan_memory_builds_the_schedule_once(monkeypatch):
    built = []

    def counting(*args):
        built.append(args)
        return build_lowered_schedule(*args)

    monkeypatch.setattr(forward_backward, "build_lowered_schedule", counting)
    model, plan = torch.nn.Linear(2, 2), TeraPipePlan([4, 4])
    first = plan_memory(model, plan)
    assert plan_memory(model, TeraPipePlan([4, 4])) is first  # equal plan: the same memory
    assert len(built) == 1 and first.schedule.lowering == GLOO
    assert first.schedule.schedule.num_microbatches == 4 and first.schedule.num_stages == 2
    assert plan_memory(model, plan, MEGATRON).schedule.lowering == MEGATRON
    assert plan_memory(model, plan, forward_only=True).schedule.schedule.forward_only
    assert plan_memory(model, plan, stages=3).schedule.num_stages == 3
    assert len(built) == 4
    monkeypatch.setitem(ORDERS, "backwards-first", backwards_first)
    with pytest.raises(ScheduleError, match="before its forward"):
        plan_memory(model, TeraPipePlan([4, 4], order="backwards-first"))


def test_the_host_time_an_iteration_no_longer_spends():
    """32 token slices, 8 microbatches, 4 stages: an iteration used to build the schedule and
    lower its stage; it now looks the kept one up. Validation (on every stage's lowered list)
    runs once, at the first iteration."""
    model, plan = torch.nn.Linear(2, 2), TeraPipePlan.uniform(2048, 32)
    config = SimpleNamespace(terapipe_cuda_graphs=False)
    key = (plan, 8, 4, 1, False, GLOO)
    forward_backward.plan_memory(model, config, torch.device("cpu"), *key)
    start = time.perf_counter()
    for _ in range(10):
        forward_backward.plan_memory(model, config, torch.device("cpu"), *key)
    cached = (time.perf_counter() - start) / 10
    start = time.perf_counter()
    for _ in range(3):
        build_lowered_schedule(plan, 8, 4, 1, lowering=GLOO)
    rebuilt = (time.perf_counter() - start) / 3
    assert cached * 20 < rebuilt, (cached, rebuilt)
