"""Laying out every stage's compute actions in the plan's order (orders.py)."""

from __future__ import annotations

from itertools import compress

from ..plan import TeraPipePlan
from .actions import Action, ActionKind, Schedule, microbatch_cells
from .orders import ORDERS


def build_schedule(plan: TeraPipePlan, num_microbatches: int, num_stages: int,
                   micro_batch_size: int, forward_only: bool = False) -> Schedule:
    """Lay out every stage's actions in the plan's order (orders.py: 1f1b, gpipe, ...), with
    the W actions of deferred weight gradients; forward_only: every stage's forwards in cell
    order."""
    _check_sizes(plan, num_microbatches, num_stages, micro_batch_size)
    per_mb = [microbatch_cells(plan, m, micro_batch_size) for m in range(num_microbatches)]
    # Every stage shares the same Action objects (stages differ in order only).
    forwards = [[Action(ActionKind.F, c) for c in cells] for cells in per_mb]
    backwards = [[Action(ActionKind.B, f.cell) for f in fs] for fs in forwards]
    weight_grads = ({id(b): Action(ActionKind.W, b.cell) for bs in backwards for b in bs}
                    if plan.defer_wgrad else {})
    # the W after each sequence's last backward (its first slice's); early ones per stage below
    last_w = {i: w for i, w in weight_grads.items() if w.cell.token_slice == 0}
    order = ORDERS[plan.order]
    stages = []
    for k in range(num_stages):
        if forward_only:
            stages.append(tuple(f for fs in forwards for f in fs))
        else:
            ordered = order(forwards, backwards, k, num_stages)
            stages.append(tuple(_with_weight_grads(ordered, plan, k, weight_grads, last_w)))
    return Schedule(plan, num_microbatches, micro_batch_size, forward_only, tuple(stages))


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
