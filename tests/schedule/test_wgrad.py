"""Deferred weight gradients (TeraPipePlan.defer_wgrad): W actions in the schedule and the
simulator's and planner's pricing of them. Their exactness against Megatron's no-pipelining
baseline is tested with the other equivalence cases (tests/equivalence/test_equivalence.py, "w_*")."""

import dataclasses

import pytest

from megatron_terapipe import TeraPipePlan
from megatron_terapipe.planner import AnalyticCostModel, FunctionCostModel, hardware_preset, model_preset
from megatron_terapipe.planner import place_wgrad_points, refine, simulate, solve
from megatron_terapipe.schedule import (Action, Schedule, ScheduleError, build_schedule, validate)
from harness import spawn


def deferred(plan: TeraPipePlan) -> TeraPipePlan:
    return dataclasses.replace(plan, defer_wgrad=True)


# ---- the schedule ------------------------------------------------------------------------------
def test_one_w_per_sequence_right_after_its_first_slice_backward():
    plan = deferred(TeraPipePlan([4, 4, 8], batch_slices=[1, 1]))
    for order in ("1f1b", "gpipe"):
        schedule = build_schedule(dataclasses.replace(plan, order=order), 3, 2, 2)
        validate(schedule)
        for actions in schedule.stages:
            ws = [i for i, a in enumerate(actions) if a.kind == "W"]
            assert len(ws) == 3 * 2  # microbatches x batch slices
            for i in ws:
                before = actions[i - 1]
                assert before.kind == "B" and before.cell == actions[i].cell
                assert before.cell.token_slice == 0


def test_no_w_without_deferral_or_backward():
    plan = TeraPipePlan([4, 4], defer_wgrad=False)
    assert not any(a.kind == "W" for s in build_schedule(plan, 2, 2, 1).stages for a in s)
    fwd = build_schedule(deferred(plan), 2, 2, 1, forward_only=True)
    assert not fwd.defer_wgrad
    assert not any(a.kind == "W" for s in fwd.stages for a in s)


def _edited(schedule: Schedule, stage: int, edit) -> Schedule:
    stages = list(schedule.stages)
    stages[stage] = tuple(edit(list(stages[stage])))
    return dataclasses.replace(schedule, stages=tuple(stages))


def test_validate_rejects_misplaced_w():
    schedule = build_schedule(deferred(TeraPipePlan([4, 4])), 1, 2, 1)
    w = next(a for a in schedule.stages[0] if a.kind == "W")

    def early(actions):  # W before the sequence's backwards
        actions.remove(w)
        return [w] + actions

    with pytest.raises(ScheduleError, match="before the backward of its cell"):
        validate(_edited(schedule, 0, early))
    with pytest.raises(ScheduleError, match="twice"):
        validate(_edited(schedule, 0, lambda a: a + [w]))
    with pytest.raises(ScheduleError, match="expected one per sequence"):
        validate(_edited(schedule, 0, lambda a: [x for x in a if x.kind != "W"]))
    plain = build_schedule(TeraPipePlan([4, 4], defer_wgrad=False), 1, 2, 1)
    with pytest.raises(ScheduleError, match="defer_wgrad=False"):
        validate(_edited(plain, 1, lambda a: a + [Action("W", w.cell)]))


def test_plan_round_trips_defer_wgrad():
    plan = deferred(TeraPipePlan([4, 4]))
    assert TeraPipePlan.from_dict(plan.to_dict()) == plan
    plain = TeraPipePlan([4, 4], defer_wgrad=False)
    assert TeraPipePlan.from_dict(plain.to_dict()).defer_wgrad is False
    assert TeraPipePlan([4, 4]).defer_wgrad is True  # the default, also of a dict without it
    assert TeraPipePlan.from_dict({"seq_slices": [4, 4]}).defer_wgrad is True
    assert "wgrad=deferred" in plan.describe()
    early = TeraPipePlan([4, 4, 4], defer_wgrad=True, wgrad_points=[[2, 1], []])
    assert early.wgrad_points == ((1, 2),)  # sorted, trailing empty stages dropped
    assert TeraPipePlan.from_dict(early.to_dict()) == early
    assert "early W: stage 0 after slices [1, 2]" in early.describe()


def test_early_w_actions_follow_their_slices_backward_per_stage():
    plan = TeraPipePlan([4, 4, 4, 4], defer_wgrad=True, wgrad_points=[[2], [1, 3]])
    for order in ("1f1b", "gpipe"):
        schedule = build_schedule(dataclasses.replace(plan, order=order), 2, 3, 1)
        validate(schedule)
        for k, expected in enumerate(([2, 0], [3, 1, 0], [0])):
            actions = schedule.stages[k]
            for m in range(2):
                ws = [i for i, a in enumerate(actions) if a.kind == "W" and a.cell.microbatch == m]
                assert [actions[i].cell.token_slice for i in ws] == expected
                for i in ws:
                    assert actions[i - 1] == Action("B", actions[i].cell)


def test_bad_wgrad_points_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="needs defer_wgrad=True"):
        TeraPipePlan([4, 4], defer_wgrad=False, wgrad_points=[[1]])
    with pytest.raises(ValueError, match="between 1 and 1"):
        TeraPipePlan([4, 4], defer_wgrad=True, wgrad_points=[[0]])
    with pytest.raises(ValueError, match="between 1 and 1"):
        TeraPipePlan([4, 4], defer_wgrad=True, wgrad_points=[[], [2]])
    with pytest.raises(ValueError, match="one list of token slices per stage"):
        TeraPipePlan([4, 4], defer_wgrad=True, wgrad_points=[1])
    plan = TeraPipePlan([4, 4], defer_wgrad=True, wgrad_points=[[], [], [1]])
    with pytest.raises(ValueError, match="for 3 pipeline stages but the pipeline has 2"):
        build_schedule(plan, 1, 2, 1)


# ---- the simulator and the planner ------------------------------------------------------------
def _function_model(wgrad_share: float) -> FunctionCostModel:
    return FunctionCostModel(forward=lambda b, l, c: 1e-3 * b * l,
                             backward=lambda b, l, c: 2e-3 * b * l,
                             wgrad=lambda b, l, c, first, last: wgrad_share * 2e-3 * b * l)


def test_simulator_moves_weight_gradient_time_from_backward_cells_to_w():
    plan = TeraPipePlan([8, 8, 16], defer_wgrad=False)
    cost = _function_model(0.5)
    plain = simulate(build_schedule(plan, 2, 2, 1), cost)
    moved = simulate(build_schedule(deferred(plan), 2, 2, 1), cost)
    # the same work on every stage, split differently
    assert sum(moved.busy) == pytest.approx(sum(plain.busy))
    for ta in moved.timeline:
        duration = ta.end - ta.start
        if ta.action.kind == "B":
            assert duration == pytest.approx(0.5 * 2e-3 * ta.action.cell.tokens)
        elif ta.action.kind == "W":
            assert duration == pytest.approx(0.5 * 2e-3 * 32)
    # the last stage's weight gradients no longer delay the gradient sent upstream
    assert moved.iteration_time < plain.iteration_time


def test_simulator_prices_each_w_as_the_slices_deferred_since_the_last_one():
    plan = TeraPipePlan([8, 8, 16], defer_wgrad=True, wgrad_points=[[1]])
    result = simulate(build_schedule(plan, 1, 2, 1), _function_model(0.5))
    ws = {(ta.stage, ta.action.cell.token_slice): ta.end - ta.start
          for ta in result.timeline if ta.action.kind == "W"}
    per_token = 0.5 * 2e-3
    assert ws == pytest.approx({(0, 1): per_token * (16 + 8), (0, 0): per_token * 8,
                                (1, 0): per_token * 32})


def _slow_last_stage(wgrad_share: float = 0.5) -> FunctionCostModel:
    """The last stage's backward carries extra, non-deferrable work (as an output layer's
    input gradient): the first stage waits for each of its output gradients."""
    return FunctionCostModel(forward=lambda b, l, c: 1e-3 * b * l,
                             backward=lambda b, l, c: 2e-3 * b * l,
                             edge_backward=lambda b, l, first, last: 2e-3 * b * l * last,
                             wgrad=lambda b, l, c, first, last: wgrad_share * 2e-3 * b * l)


def test_early_w_fills_the_first_stage_waits_as_well_as_any_placement():
    cost = _slow_last_stage()
    plan = TeraPipePlan([8, 8, 8, 8], defer_wgrad=True)
    start = simulate(build_schedule(plan, 1, 2, 1), cost).iteration_time
    placed, placed_time = place_wgrad_points(plan, cost, 1, 2, 1)
    assert placed.wgrad_points and placed.wgrad_points[0]
    assert placed_time == pytest.approx(
        simulate(build_schedule(placed, 1, 2, 1), cost).iteration_time)
    assert placed_time < 0.96 * start  # the first stage no longer ends on all its W
    best = min(simulate(build_schedule(dataclasses.replace(plan, wgrad_points=[a, b]), 1, 2, 1),
                        cost).iteration_time
               for a in _subsets((1, 2, 3)) for b in _subsets((1, 2, 3)))
    assert placed_time <= best * (1 + 5e-3)  # greedy reaches brute force, to its min_gain


def _subsets(items):
    return [[x for i, x in enumerate(items) if mask >> i & 1] for mask in range(1 << len(items))]


def test_refine_keeps_the_early_w_actions_that_still_fit():
    # a large fixed cost per cell: the climb merges slices, and points past the end must go
    cost = FunctionCostModel(forward=lambda b, l, c: 1e-3 * b * l + 0.05,
                             backward=lambda b, l, c: 2e-3 * b * l + 0.1,
                             wgrad=lambda b, l, c, first, last: 1e-3 * b * l)
    plan = TeraPipePlan([8, 8, 8, 8], defer_wgrad=True, wgrad_points=[[3, 1], [2]])
    refined, refined_time = refine(plan, cost, 1, 2, 1, unit=8)
    n = len(refined.seq_slices)
    assert n < 4
    kept = [[j for j in (1, 3) if j < n], [j for j in (2,) if j < n]]
    assert refined.wgrad_points == TeraPipePlan(refined.seq_slices, defer_wgrad=True,
                                                wgrad_points=kept).wgrad_points
    assert refined_time == pytest.approx(
        simulate(build_schedule(refined, 1, 2, 1), cost).iteration_time)


def test_no_early_w_without_deferral():
    plan = TeraPipePlan([8, 8, 8, 8], defer_wgrad=False)
    assert place_wgrad_points(plan, _slow_last_stage(), 1, 2, 1)[0] == plan


def test_analytic_wgrad_share_is_the_linear_layers_half_of_backward():
    cost = AnalyticCostModel(model_preset("gpt3-13b"), hardware_preset("a100"), layers_per_stage=4)
    back = cost.backward_time(1, 512, 0)
    share = cost.wgrad_time(1, 512, 0, False, False) / back
    assert 0.3 < share < 0.5  # attention's backward is the rest
    # a longer context adds attention work only: the weight-gradient seconds barely move
    assert cost.wgrad_time(1, 512, 4096, False, False) == pytest.approx(
        cost.wgrad_time(1, 512, 0, False, False), rel=0.1)


def test_solve_lets_the_simulator_choose_deferral():
    cost = AnalyticCostModel(model_preset("gpt3-13b"), hardware_preset("a100"), layers_per_stage=5)
    chosen = solve(cost, 2048, 1, 4, granularity=128, num_microbatches=1, defer_wgrad=None)
    forced = {d: solve(cost, 2048, 1, 4, granularity=128, num_microbatches=1, defer_wgrad=d)
              for d in (False, True)}
    assert forced[True].defer_wgrad and not forced[False].defer_wgrad
    # with one microbatch, the last stages' W fills the drain: well over the 1% bar
    assert chosen.defer_wgrad
    assert chosen.predicted_time < 0.99 * forced[False].predicted_time


def test_solve_does_not_defer_for_a_negligible_gain():
    """A sliver of weight-gradient time: deferring gains under 1%, not worth its memory."""
    cost = FunctionCostModel(forward=lambda b, l, c: 1e-3 * b * l,
                             wgrad=lambda b, l, c, first, last: 1e-6 * b * l)
    chosen = solve(cost, 64, 1, 2, granularity=8, defer_wgrad=None)
    deferred = solve(cost, 64, 1, 2, granularity=8)  # the default
    assert deferred.predicted_time < chosen.predicted_time  # a real gain, but a tiny one
    assert not chosen.defer_wgrad and deferred.defer_wgrad


def test_hooked_layers_run_megatrons_code_outside_terapipe():
    assert spawn(1, "harness:grads_with_and_without_deferral_hooks")[0] == 0.0


def test_weight_grad_sums_every_slice_and_rounds_16_bit_types_once():
    import torch

    from megatron_terapipe.runtime.wgrad.store import WeightGradPiece

    torch.manual_seed(0)
    xs = [torch.randn(3, 1, 5) for _ in range(4)]  # [tokens, rows, in] per slice
    gs = [torch.randn(3, 1, 6) for _ in range(4)]  # [tokens, rows, out]

    def grad(dtype):
        weight = torch.nn.Parameter(torch.zeros(6, 5, dtype=dtype))
        pieces = [WeightGradPiece(x.to(dtype), g.to(dtype), False, None, False) for x, g in zip(xs, gs)]
        [(param, grad)] = WeightGradPiece.gradients(weight, pieces)  # no bias: one gradient
        assert param is weight
        return grad

    def one_gemm(dtype):
        g = torch.cat(gs).to(dtype).reshape(-1, 6)
        x = torch.cat(xs).to(dtype).reshape(-1, 5)
        return g.t() @ x

    torch.testing.assert_close(grad(torch.float32), one_gemm(torch.float32))
    assert torch.equal(grad(torch.bfloat16), one_gemm(torch.bfloat16))
