"""A schedule as the executor runs it: built, validated and lowered once per plan and shape.

`build_lowered_schedule` builds the per-stage compute lists (build.py), checks them with
`validate` (so a bad schedule fails with its ScheduleError grid before any communication) and
keeps the lowered lists that check made for the transport's `Lowering`. The Megatron glue
keeps one per plan and batch shape with the plan's buffers (`PlanMemory`,
megatron/hooks/forward_backward.py) and hands it to every iteration's executor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import TeraPipePlan
from .actions import Action, Schedule
from .build import build_schedule
from .lower import Lowering
from .replay import Lowered
from .validate import validate


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
