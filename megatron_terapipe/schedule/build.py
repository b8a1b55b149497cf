"""Laying out every stage's compute actions in the plan's order (orders.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import compress
from typing import Optional, Sequence

from ..plan import TeraPipePlan
from .actions import Action, ActionKind, Schedule, microbatch_cells
from .lower import Lowering
from .orders import CHUNKED_ORDERS, ORDERS
from .timing import Lowered
from .v_order import V_ORDERS
from .validate import validate


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


# Where a stage's W actions run: a plan's `wgrad_after` applied to a stage's list.
#
# The builder first lays out a stage's W actions in their default places (a sequence's W right
# after its last backward, early ones after their slices' backwards). A plan that places them
# (`TeraPipePlan.wgrad_after`, filled by the planner's list scheduling) gives, for each of those
# W actions in that order, how many of the stage's F and B actions run before it; this module
# moves them there. A W computes every weight gradient its sequence (on its chunk) deferred
# since its previous W, so a later place only makes it cover the same backwards later (or, past
# an early W's next backward, that one too), which the executor and the simulator both do.

def default_places(actions: Sequence[Action]) -> list[int]:
    """For each W action of `actions`, how many F and B actions run before it."""
    out, compute = [], 0
    for a in actions:
        if a.kind == "W":
            out.append(compute)
        else:
            compute += 1
    return out


def place_weight_grads(actions: Sequence[Action], places: Optional[Sequence[int]],
                       stage: int) -> list[Action]:
    """`actions` (W actions in their default places) with W number i after `places[i]` F and
    B actions; None: as they are. Raises ValueError naming the stage and the W that a place
    would run before its own backward, or a count that does not match."""
    if places is None:
        return list(actions)
    weight_grads = [a for a in actions if a.kind == "W"]
    others = [a for a in actions if a.kind != "W"]
    if len(places) != len(weight_grads):
        raise ValueError(
            f"the TeraPipe plan places {len(places)} W actions on stage {stage} (wgrad_after) "
            f"but the schedule has {len(weight_grads)} there: plan the W places for this "
            "schedule (the same slices, microbatches, order and virtual stages), or leave "
            "wgrad_after unset (Megatron-LM: --terapipe-wgrad-placement off)")
    earliest = default_places(actions)
    for w, place, least in zip(weight_grads, places, earliest):
        if not least <= place <= len(others):
            raise ValueError(
                f"the TeraPipe plan places {w} on stage {stage} after {place} F/B actions "
                f"(wgrad_after), but it must run after its backward (at least {least}) and "
                f"within the stage's {len(others)} F/B actions")
    out: list[Action] = []
    i = 0
    for w, place in zip(weight_grads, places):
        out += others[i:place]
        i = max(i, place)
        out.append(w)
    return out + others[i:]


# A schedule as the executor runs it: built, validated and lowered once per plan and shape.
#
# `build_lowered_schedule` builds the per-stage compute lists (build.py), checks them with
# `validate` (so a bad schedule fails with its ScheduleError grid before any communication) and
# keeps the lowered lists that check made for the transport's `Lowering`. The Megatron glue
# keeps one per plan and batch shape with the plan's buffers (`PlanMemory`,
# megatron/hooks/forward_backward.py) and hands it to every iteration's executor.

@dataclass(frozen=True)
class LoweredSchedule:
    """`schedule` with every stage's lowered list for `lowering`, validated."""

    schedule: Schedule
    lowering: Lowering
    stages: Lowered  # stages[k]: stage k's compute and communication actions, in order

    @classmethod
    def of(cls, schedule: Schedule, lowering: Lowering = Lowering()) -> "LoweredSchedule":
        """Validate `schedule` (ScheduleError with its grid) and keep its lowered lists."""
        return cls(schedule, lowering, validate(schedule, lowering))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage(self, k: int) -> tuple[Action, ...]:
        return self.stages[k]


def build_lowered_schedule(plan: TeraPipePlan, num_microbatches: int, num_stages: int,
                           micro_batch_size: int, forward_only: bool = False,
                           lowering: Lowering = Lowering()) -> LoweredSchedule:
    """`build_schedule`'s schedule, validated and lowered for `lowering`."""
    schedule = build_schedule(plan, num_microbatches, num_stages, micro_batch_size, forward_only)
    return LoweredSchedule.of(schedule, lowering)
