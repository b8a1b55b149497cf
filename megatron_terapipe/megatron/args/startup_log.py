"""What rank 0 logs about the plan at start-up, in Megatron's `> ...` style: where the slices
came from, a to-scale picture of one microbatch's cells, and the simulator's prediction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ...plan import TeraPipePlan
from ...planner.cli.report import slice_picture
from ...schedule.build import virtual_group
from ..support.refusals import SLICE_ATTENTION

PICTURE_WIDTH = 60  # columns of boxes; with the row names and the "> " prefix under 80
#: Notes that must not be missed (a guessed GPU, ...): logged as `> terapipe: WARNING: ...`.
WARNING = "WARNING: "


def attention_text(backend: str) -> str:
    """Which attention the layers run, for the report (--attention-backend `backend` cannot
    change it)."""
    return f"{SLICE_ATTENTION}, for --attention-backend {backend}"


@dataclass
class PlanReport:
    """Where a plan came from and what the simulator predicts for it."""

    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    num_stages: int
    source: str
    cost_model: str
    iteration_time: Optional[float] = None
    bubble: Optional[float] = None
    baseline_time: Optional[float] = None  # 1F1B without token slices
    baseline_bubble: Optional[float] = None
    notes: list[str] = field(default_factory=list)
    peak_bytes: Optional[tuple[float, ...]] = None  # per stage, model state included
    budget_bytes: Optional[float] = None  # --terapipe-memory-budget
    model_state: tuple[float, ...] = ()  # per stage: weights, gradients, optimizer state
    attention: str = ""  # what the layers' core attention runs

    def lines(self, plan: TeraPipePlan) -> list[str]:
        out = [f"> terapipe plan for seq_length {self.seq_length}, micro_batch_size "
               f"{self.micro_batch_size}, {self.num_microbatches} microbatches, "
               f"{self.num_stages} pipeline stages:"]
        rows = plan.batch_slices or (None,)
        for r, ts in zip(rows, plan.token_slices):
            who = f"{r} rows" if r is not None else "all rows"
            out.append(f">   token slices ({who}) ... {' '.join(map(str, ts))}")
        for which, (n, ts) in zip(("first", "last"), plan.edge_slices):
            if n:  # edge slicing: these microbatches fill and drain the pipeline in slices
                out.append(f">   {which} {n} microbatches ...... {' '.join(map(str, ts))}")
        out.append(">   one microbatch to scale:")
        out.extend(f">     {row}" for row in slice_picture(plan, PICTURE_WIDTH))
        out.append(f">   order ..................... {plan.order}")
        if plan.virtual_stages > 1:
            out.append(">   virtual stages ............ " + self._virtual_text(plan))
        wgrad = "deferred: one W action per sequence" if plan.defer_wgrad else "in every backward cell"
        if plan.wgrad_points:
            wgrad += f"; {plan.early_w_text()}"
        if plan.wgrad_after:
            wgrad += "; W actions placed in the stages' waits"
        out.append(">   weight gradients .......... " + wgrad)
        if plan.defer_wgrad:  # the rule, and how to change it
            out.append(">     (the default: exact, one accumulation per parameter and sequence;")
            out.append(">     layers TeraPipe does not hook (Transformer Engine's) keep theirs there;")
            out.append(">     --terapipe-defer-wgrad off: all there, less memory held)")
        if plan.wgrad_after:
            out.append(">     (--terapipe-wgrad-placement off: each W after its sequence's last backward)")
        out.append(f">   slices from ............... {self.source}")
        if self.attention:
            out.append(f">   attention ................. {self.attention}")
        out.append(f">   cost model ................ {self.cost_model}")
        out.extend(self._prediction_lines())
        out.extend(f">   note: {n}" for n in self.notes if not n.startswith(WARNING))
        out.extend(f"> terapipe: {n}" for n in self.notes if n.startswith(WARNING))
        return out

    def _virtual_text(self, plan: TeraPipePlan) -> str:
        """Model chunks per stage, and in the 1f1b order the interleaved order's microbatch
        groups and the warm-up."""
        text = f"{plan.virtual_stages} model chunks per stage"
        if plan.virtual_placement == "v":
            text += " in a V (rank k: virtual stages k and 2K - 1 - k)"
            lead = plan.virtual_warmup
            return text + (f", lead {lead}" if lead is not None and plan.order == "1f1b" else "")
        if plan.order != "1f1b":
            return text + ", every forward first (no microbatch groups)"
        group = virtual_group(plan, self.num_microbatches, self.num_stages)
        text += f", microbatches in groups of {group}"
        if plan.virtual_warmup is not None:
            text += f", warm-up {plan.virtual_warmup} (fewer units in flight than Megatron's)"
        return text

    def _prediction_lines(self) -> list[str]:
        out = []
        if self.iteration_time is not None:
            line = f">   predicted iteration ....... {self.iteration_time * 1e3:.3f} ms"
            if self.baseline_time:
                line += (f" (1F1B without token slices: {self.baseline_time * 1e3:.3f} ms, "
                         f"{self.baseline_time / max(self.iteration_time, 1e-30):.2f}x)")
            out.append(line)
        if self.bubble is not None:
            line = f">   pipeline bubble ........... {100 * self.bubble:.1f}%"
            if self.baseline_bubble is not None:
                line += f" (1F1B without token slices: {100 * self.baseline_bubble:.1f}%)"
            out.append(line)
        return out + self._memory_lines()

    def _memory_lines(self) -> list[str]:
        """Predicted peak per stage (GiB, model state included) and the budget."""
        if self.peak_bytes is None:
            return []
        gib = 1024 ** 3
        state = max(self.model_state, default=0.0)
        line = (">   predicted peak (GiB) ...... " + " ".join(f"{p / gib:.2f}" for p in self.peak_bytes[:8])
                + (" ..." if len(self.peak_bytes) > 8 else "")
                + f" per stage (with up to {state / gib:.2f} of weights, gradients, optimizer state)")
        out = [line]
        if self.budget_bytes is not None:
            out.append(f">   memory budget ............. {self.budget_bytes / gib:.2f} GiB per GPU: "
                       f"fits (largest peak {max(self.peak_bytes) / gib:.2f})")
        return out
