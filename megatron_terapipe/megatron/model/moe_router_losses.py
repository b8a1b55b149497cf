"""Megatron-Core's MoE router losses, exact under token slices.

The load-balancing losses (aux_loss, seq_aux_loss, global_aux_loss) and the z-loss are
functions of a whole microbatch's routing (model/moe_loss_sums.py says how). `install_moe_losses`
hooks every TopKRouter that has one, per instance:

- `routing`: in the forward of a training cell, count the cell's tokens per expert (as
  Megatron's router would for the loss: `compute_routing_scores_for_aux_loss`, reduced over
  the loss's group) and its z-loss sum into the microbatch's terms, whatever the grad mode (a
  layer under full recomputation runs its first forward without grad); once the microbatch's
  last cell was counted, log each loss once in Megatron's tracker and add global_aux_loss's
  counts to the router's running mean;
- `_apply_aux_loss`, `_apply_seq_aux_loss`, `_apply_global_aux_loss`, `apply_z_loss`: inside
  a cell, attach the microbatch's gradient (SwitchLossGrad, ZLossGrad) instead of the cell's.

Outside TeraPipe cells (Megatron's own schedules, evaluation) the router runs as is.
`begin_iteration` sets Megatron's MoEAuxLossAutoScaler scale as Megatron's forward_step does
and starts each iteration's counts.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional

import torch

from ...runtime.context import ActiveCell, active_cell
from ...schedule import ActionKind, Schedule
from ..platform import router_versions
from .moe_loss_sums import (SWITCH_LOSS_NAMES, LossShape, MicrobatchLosses, SwitchLossGrad,
                             SwitchTerm, ZLossGrad, ZTerm, squared_logsumexp, token_owners)

SWITCH_METHODS = router_versions.SWITCH_METHODS


def has_losses(router) -> bool:
    """Whether Megatron's router adds a load-balancing loss or the z-loss in training."""
    return router.is_aux_loss_enabled() or router.config.moe_z_loss_coeff is not None


def install_moe_losses(model: torch.nn.Module) -> int:
    """Hook every router of `model` that has losses (once); returns how many. Raises before
    any work where this megatron-core line's losses cannot be reproduced."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter) and has_losses(m)]
    if routers:
        router_versions.router_class()
        problem = router_versions.line_problem()
        if problem:
            raise ValueError(problem)
    for router in routers:
        if getattr(router, "_terapipe_losses", None) is None:
            _hook(router, RouterLosses(router))
    model._terapipe_moe_losses = [router._terapipe_losses for router in routers]
    return len(routers)


def begin_iteration(model: torch.nn.Module, config, schedule: Schedule,
                    device: torch.device) -> None:
    """Before a run's first cell: Megatron's aux-loss scale, fresh counts per router, and the
    check that every stage forwards a whole microbatch before its first backward."""
    if not getattr(config, "num_moe_experts", None):
        return
    set_aux_loss_scale(config, schedule.num_microbatches, device)
    states = getattr(model, "_terapipe_moe_losses", [])
    if not states:
        return
    if not schedule.forward_only:
        check_forwards_first(schedule)
    for state in states:
        state.begin_iteration(schedule.micro_batch_size, schedule.plan.seq_length)


def set_aux_loss_scale(config, num_microbatches: int, device: torch.device) -> None:
    """MoEAuxLossAutoScaler's scale as Megatron's forward_step sets it (the same for every
    microbatch): the loss scale, divided by the microbatch count unless per-token."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    loss_scale = router_versions.moe_loss_scale(config, device)
    if config.calculate_per_token_loss:
        MoEAuxLossAutoScaler.set_loss_scale(loss_scale)
    else:
        MoEAuxLossAutoScaler.set_loss_scale(loss_scale / num_microbatches)


_CHECKED: dict[int, weakref.ref] = {}


def check_forwards_first(schedule: Schedule) -> None:
    """Every stage runs all forwards of a microbatch (all its batch and token slices) before
    the first of its backwards: then a backward finds the microbatch's counts complete. Both
    orders do (orders.py); checked once per schedule."""
    seen = _CHECKED.get(id(schedule))
    if seen is not None and seen() is schedule:
        return
    for stage, actions in enumerate(schedule.stages):
        backward_started: set[int] = set()
        for action in actions:
            if action.kind == ActionKind.B:
                backward_started.add(action.cell.microbatch)
            elif action.kind == ActionKind.F and action.cell.microbatch in backward_started:
                raise ValueError(
                    f"TeraPipe: stage {stage} runs the forward of cell {action.cell} after a "
                    f"backward of microbatch {action.cell.microbatch}, but MoE load-balancing "
                    "losses and the z-loss need all of a microbatch's counts before its first "
                    f"backward: use order 1f1b or gpipe (order {schedule.plan.order!r})")
    _CHECKED[id(schedule)] = weakref.ref(schedule)


def _loss_scale() -> torch.Tensor:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    return scale if scale is not None else torch.tensor(1.0)


class RouterLosses:
    """One router's losses: its settings, and per microbatch of the running iteration the
    terms its cells add to."""

    def __init__(self, router) -> None:
        self.router = router
        self.switch_coeffs = {kind: float(router.get_aux_loss_coeff(kind))
                              for kind in SWITCH_LOSS_NAMES if router.get_aux_loss_coeff(kind) > 0}
        z_coeff = router.config.moe_z_loss_coeff
        self.z_coeff = None if z_coeff is None else z_coeff / router.tp_cp_group.size()
        self.shape: Optional[LossShape] = None
        self.tokens_per_microbatch = 0
        self.microbatches: dict[int, MicrobatchLosses] = {}

    def begin_iteration(self, micro_batch_size: int, seq_length: int) -> None:
        router = self.router
        self.shape = LossShape(router.config.num_moe_experts, router.topk, micro_batch_size,
                               seq_length, bool(router.calculate_per_token_loss), _loss_scale,
                               router.tp_cp_group.size(), router.tp_cp_group.rank(),
                               router_versions.per_token_factor(router),
                               router_versions.seq_aux_tokens_per_sequence())
        self.tokens_per_microbatch = micro_batch_size * seq_length
        self.microbatches = {}

    def training_cell(self) -> Optional[ActiveCell]:
        """The running cell when it trains this router (not forward-only, not eval mode)."""
        active = active_cell()
        if active is None or not active.keep_grad or not self.router.training:
            return None
        return active

    def losses_of(self, microbatch: int) -> MicrobatchLosses:
        losses = self.microbatches.get(microbatch)
        if losses is None:
            if self.shape is None:
                raise RuntimeError(
                    "TeraPipe: MoE router losses are counted per iteration by "
                    "forward_backward_terapipe: run the model through TeraPipe's schedule")
            losses = MicrobatchLosses(
                {kind: SwitchTerm(kind, coeff, self.shape) for kind, coeff in self.switch_coeffs.items()},
                None if self.z_coeff is None else ZTerm(self.z_coeff, self.shape))
            self.microbatches[microbatch] = losses
        return losses

    def owners(self, active: ActiveCell, seq: int) -> torch.Tensor:
        return token_owners(self.shape, active.cell.token_start, seq)

    def count(self, active: ActiveCell, logits: torch.Tensor,
              padding_mask: Optional[torch.Tensor]) -> None:
        """Add one forward cell's routing ([seq, rows, experts] logits) to its microbatch."""
        from megatron.core.transformer.moe.moe_utils import (
            compute_routing_scores_for_aux_loss, get_tokens_per_expert_and_token_count)

        router, cell = self.router, active.cell
        check_padding_mask(logits, padding_mask)
        losses = self.losses_of(cell.microbatch)
        seq, rows = logits.shape[0], slice(cell.row_start, cell.row_end)
        owners = self.owners(active, seq)
        flat = logits.reshape(-1, router.config.num_moe_experts)
        mask = padding_mask.reshape(-1) if padding_mask is not None else None
        with torch.no_grad():
            valid = (torch.ones(logits.shape[:2], device=logits.device) if padding_mask is None
                     else ~padding_mask.reshape(logits.shape[:2]))
            losses.add_tokens(valid, owners, self.shape.tp_size)
            if losses.z is not None:
                losses.z.add(squared_logsumexp(flat, mask).view(seq, -1), owners)
            if losses.switch:
                routing_map, scores = compute_routing_scores_for_aux_loss(
                    flat, router.topk, router.score_function,
                    fused=router.config.moe_router_fusion, padding_mask=mask)
                for term in losses.switch.values():
                    counter = functools.partial(get_tokens_per_expert_and_token_count,
                                                reduce_group=self._group(term.kind),
                                                with_padding_mask=mask is not None)
                    term.add(routing_map, scores, rows, seq, counter, padded=mask is not None)
        losses.tokens += cell.rows * cell.tokens
        if losses.tokens == self.tokens_per_microbatch:
            self._finish(losses)

    def _group(self, kind: str):
        return self.router.tp_dp_cp_group if kind == "global_aux_loss" else self.router.tp_cp_group

    def _finish(self, losses: MicrobatchLosses) -> None:
        """The microbatch's last cell was counted: sum the per-rank bins over TP, complete the
        terms, log each loss once."""
        router = self.router
        with torch.no_grad():
            if self.shape.tp_size > 1:
                torch.distributed.all_reduce(losses.owner_tokens, group=router.tp_cp_group)
                if losses.z is not None:
                    torch.distributed.all_reduce(losses.z.sums, group=router.tp_cp_group)
            layers = router.config.num_layers
            for kind, term in losses.switch.items():
                term.finish(router, losses.owner_tokens)
                router_versions.record_router_loss(
                    SWITCH_LOSS_NAMES[kind], term.value() / term.coeff, router.layer_number,
                    layers, reduce_group=self._group(kind),
                    dp_average=kind != "global_aux_loss")
            if losses.z is not None:
                losses.z.tokens, losses.z.complete = losses.owner_tokens, True
                router_versions.record_z_loss(router, losses.z.value() / losses.z.coeff, layers)
        losses.complete = True


def check_padding_mask(logits: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> None:
    """A padding mask with as many tokens as the router routes ([seq, rows, experts] logits)."""
    routed = logits.shape[0] * logits.shape[1]
    if padding_mask is not None and padding_mask.numel() != routed:
        raise ValueError(
            f"TeraPipe: the MoE padding mask holds {padding_mask.numel()} tokens but this router "
            f"routes {routed}: under sequence parallelism Megatron-Core's GPTModel splits the "
            "padding mask over the tensor-parallel ranks on the first pipeline stage only, so "
            "the MoE layers of later stages get the whole mask (Megatron's own pipeline "
            "schedules fail there too): give the model no padding_mask, or run without "
            "sequence parallelism")


def _hook(router, state: RouterLosses) -> None:
    router._terapipe_losses = state
    router.routing = _counting_routing(state, router.routing)
    router.apply_z_loss = _z_loss(state, router.apply_z_loss)
    for name, kind in SWITCH_METHODS.items():
        setattr(router, name, _switch_loss(state, kind, getattr(router, name)))


def _counting_routing(state: RouterLosses, original: Callable) -> Callable:
    def routing(logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        active = state.training_cell()
        if active is not None and active.phase == "forward":
            state.count(active, logits, padding_mask)
        return original(logits, padding_mask=padding_mask)

    return routing


def _switch_loss(state: RouterLosses, kind: str, original: Callable) -> Callable:
    def apply(probs: torch.Tensor, scores: torch.Tensor, routing_map: torch.Tensor, *args,
              **kwargs) -> torch.Tensor:
        active = state.training_cell()
        if active is None or kind not in state.switch_coeffs:
            return original(probs, scores, routing_map, *args, **kwargs)
        cell = active.cell
        term = state.losses_of(cell.microbatch).switch[kind]
        owners = state.owners(active, scores.shape[0] // cell.rows)
        return SwitchLossGrad.apply(probs, scores, term, slice(cell.row_start, cell.row_end),
                                    owners)

    return apply


def _z_loss(state: RouterLosses, original: Callable) -> Callable:
    def apply_z_loss(logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        active = state.training_cell()
        if active is None or state.z_coeff is None or not torch.is_grad_enabled():
            return original(logits, padding_mask=padding_mask)
        values = squared_logsumexp(logits, padding_mask)
        owners = state.owners(active, logits.shape[0] // active.cell.rows)
        return ZLossGrad.apply(logits, values, state.losses_of(active.cell.microbatch).z, owners)

    return apply_z_loss
