"""Laying out every stage's compute actions in the plan's order (orders.py)."""

from __future__ import annotations

from dataclasses import replace
from itertools import compress

from ..plan import TeraPipePlan
from .actions import Action, ActionKind, Schedule, microbatch_cells
from .orders import CHUNKED_ORDERS, ORDERS
from .v_order import V_ORDERS
from .wgrad_places import place_weight_grads


def build_schedule(plan: TeraPipePlan, num_microbatches: int, num_stages: int,
                   micro_batch_size: int, forward_only: bool = False) -> Schedule:
    """Lay out every stage's actions in the plan's order (orders.py: 1f1b, gpipe, ...), with
    the W actions of deferred weight gradients; forward_only: every stage's forwards in cell
    order."""
    _check_sizes(plan, num_microbatches, num_stages, micro_batch_size)
    V = plan.virtual_stages
    chunks = [None] if V == 1 else list(range(V))
    per_chunk = [[microbatch_cells(plan, m, micro_batch_size, c, num_microbatches)
                  for m in range(num_microbatches)] for c in chunks]
    # Every stage shares the same Action objects (stages differ in order only).
    forwards = [[[Action(ActionKind.F, c) for c in cells] for cells in per_mb] for per_mb in per_chunk]
    backwards = [[[Action(ActionKind.B, f.cell) for f in fs] for fs in per_mb] for per_mb in forwards]
    weight_grads = ({id(b): Action(ActionKind.W, b.cell) for per_mb in backwards
                     for bs in per_mb for b in bs} if plan.defer_wgrad else {})
    # the W after each sequence's last backward (its first slice's); early ones per stage below
    last_w = {i: w for i, w in weight_grads.items() if w.cell.token_slice == 0}
    group = virtual_group(plan, num_microbatches, num_stages)
    if forward_only:
        every_forward = tuple(f for per_mb in forwards for fs in per_mb for f in fs)
        return Schedule(plan, num_microbatches, micro_batch_size, forward_only,
                        (every_forward,) * num_stages)
    stages = []
    for k, ordered in enumerate(_stage_orders(plan, forwards, backwards, num_stages, group)):
        actions = _with_weight_grads(ordered, plan, k, weight_grads, last_w)
        if plan.wgrad_after:
            actions = place_weight_grads(actions, plan.wgrad_after[k] if k < len(plan.wgrad_after)
                                         else None, k)
        stages.append(tuple(actions))
    return Schedule(plan, num_microbatches, micro_batch_size, forward_only, tuple(stages))


def _stage_orders(plan: TeraPipePlan, forwards: list, backwards: list, num_stages: int,
                  group: int) -> list[list[Action]]:
    """Every stage's forwards and backwards in the plan's order (orders.py; a V's, v_order.py)."""
    if plan.virtual_stages == 1:
        return [ORDERS[plan.order](forwards[0], backwards[0], k, num_stages)
                for k in range(num_stages)]
    if plan.virtual_placement == "v":
        return V_ORDERS[plan.order](forwards, backwards, num_stages, plan.virtual_warmup)
    return [CHUNKED_ORDERS[plan.order](forwards, backwards, k, num_stages, group,
                                       plan.virtual_warmup) for k in range(num_stages)]


def virtual_group(plan: TeraPipePlan, num_microbatches: int, num_stages: int) -> int:
    """Microbatches per group of the interleaved order (virtual stages): the plan's, or the
    fewest that allowed_group accepts (Megatron's default group is K microbatches: enough
    units for the first rank to work on while one travels round the other ranks)."""
    if plan.virtual_group is not None:
        group = min(plan.virtual_group, num_microbatches)
        if not allowed_group(group, num_microbatches, num_stages, plan.num_cells):
            cells = plan.num_cells
            raise ValueError(
                f"the TeraPipe plan groups {group} microbatches (virtual_group) on virtual "
                f"stages: with {cells} cells per microbatch that is {group * cells} units per "
                f"group and {num_microbatches % group * cells} in the last, but every group "
                f"needs at least {num_stages} units (pipeline stages), or one group must hold "
                f"all {num_microbatches} microbatches: use virtual_group="
                f"{virtual_group(replace(plan, virtual_group=None), num_microbatches, num_stages)}"
                " or leave it unset")
        return group
    least = -(-num_stages // plan.num_cells)
    return next(g for g in range(least, num_microbatches + 1)
                if allowed_group(g, num_microbatches, num_stages, plan.num_cells)) \
        if least < num_microbatches else num_microbatches


def allowed_group(group: int, num_microbatches: int, num_stages: int, cells: int) -> bool:
    """Megatron's interleaved conditions counted in units (cells) instead of microbatches: a
    group holds at least K units and so does a shorter last group (or there is none). One group
    of all microbatches always runs (our sends do not wait for the receiver): no microbatch
    count is refused. Proven deadlock-free by `validate` on every shape of tests/
    test_virtual_stages.py; outside these conditions some shapes deadlock."""
    if group >= num_microbatches:
        return True
    last = num_microbatches % group * cells
    return group * cells >= num_stages and (last == 0 or last >= num_stages)


def _check_sizes(plan: TeraPipePlan, num_microbatches: int, num_stages: int,
                 micro_batch_size: int) -> None:
    if num_microbatches <= 0:
        raise ValueError(f"num_microbatches must be positive, got {num_microbatches}")
    if num_stages <= 0:
        raise ValueError(f"number of pipeline stages must be positive, got {num_stages}")
    if plan.batch_slices is not None:
        plan.validate(plan.seq_length, micro_batch_size)
    if len(plan.wgrad_points) > num_stages:
        raise ValueError(
            f"the TeraPipe plan places early W actions (wgrad_points) for "
            f"{len(plan.wgrad_points)} pipeline stages but the pipeline has {num_stages}: plan "
            f"for {num_stages} stages (terapipe-plan --pipeline-stages {num_stages})")
    if plan.virtual_stages > 1 and num_stages < 2:
        raise ValueError(
            f"the TeraPipe plan runs {plan.virtual_stages} model chunks per stage "
            "(virtual_stages) on one pipeline stage: virtual stages need at least 2 pipeline "
            "stages; use virtual_stages=1")
    if len(plan.wgrad_after) > num_stages:
        raise ValueError(
            f"the TeraPipe plan places W actions (wgrad_after) for {len(plan.wgrad_after)} "
            f"pipeline stages but the pipeline has {num_stages}: plan for {num_stages} stages")


def _with_weight_grads(actions: list[Action], plan: TeraPipePlan, stage: int,
                       weight_grads: dict[int, Action], last_w: dict[int, Action]) -> list[Action]:
    """A W right after each sequence's last backward (that of its first token slice), and after
    the backward of the stage's `wgrad_points` slices. A W computes every weight gradient its
    sequence deferred since the previous W."""
    if not plan.defer_wgrad:
        return actions
    early = set(plan.wgrad_points_of(stage))
    after = last_w if not early else {i: w for i, w in weight_grads.items()
                                      if w.cell.token_slice == 0 or w.cell.token_slice in early}
    out: list[Action] = []
    start = 0
    for i in compress(range(len(actions)), map(after.get, map(id, actions))):
        out += actions[start:i + 1]
        out.append(after[id(actions[i])])
        start = i + 1
    return out + actions[start:]
