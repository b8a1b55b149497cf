"""PlanTable: plans by sequence length, for runs whose sequence length changes between
iterations."""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from .terapipe_plan import TeraPipePlan


class PlanTable:
    """Plans by sequence length, for runs whose sequence length changes between iterations.

    Looks a length up in `plans`; otherwise asks `planner(seq_length, micro_batch_size)` once
    and caches the answer. Pass it to `configure(config, PlanTable(...))`.
    """

    def __init__(self, plans: Optional[Mapping[int, TeraPipePlan]] = None,
                 planner: Optional[Callable[[int, int], TeraPipePlan]] = None) -> None:
        self.plans: dict[tuple[int, Optional[int]], TeraPipePlan] = {
            (int(k), None): v for k, v in (plans or {}).items()}
        for length, plan in self.plans.items():
            if plan.seq_length != length[0]:
                raise ValueError(
                    f"PlanTable: the plan for length {length[0]} has slices summing to "
                    f"{plan.seq_length}")
        self.planner = planner

    def plan_for(self, seq_length: int, micro_batch_size: int) -> TeraPipePlan:
        for key in ((seq_length, micro_batch_size), (seq_length, None)):
            if key in self.plans:
                return self.plans[key]
        if self.planner is None:
            known = sorted({k[0] for k in self.plans})
            raise ValueError(
                f"TeraPipe has no plan for sequence length {seq_length} (plans exist for "
                f"lengths {known}): add a plan for {seq_length} or give PlanTable a planner")
        plan = self.planner(seq_length, micro_batch_size)
        plan.validate(seq_length, plan.batch_slices and sum(plan.batch_slices) or micro_batch_size)
        self.plans[(seq_length, micro_batch_size)] = plan
        return plan
