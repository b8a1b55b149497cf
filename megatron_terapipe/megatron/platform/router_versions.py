"""The version-sensitive part of the MoE router-loss touch point (model/moe_router_losses.py), checked as
compat.py checks the others.

megatron-core 0.16 to 0.19 compute the same router losses
(`switch_load_balancing_loss_func`, `z_loss_func`, the same counts) but scale and log them
differently (router.py; 0.17 scales and logs as 0.16 does, 0.18 scales as 0.16 does and logs
through 0.19's tracker, the z-loss as each rank's value):

- with `calculate_per_token_loss`, 0.16 multiplies a loss it attaches by the rank's token count,
  0.19 by that count x the TP x CP size; for `seq_aux_loss` 0.16's count is per sequence (the
  microbatch's / its rows), 0.19's the microbatch's;
- 0.16 logs through `moe_utils.save_to_aux_losses_tracker` (the z-loss as each rank's value),
  0.19 through `moe_logging.get_moe_metrics_tracker().record` (the z-loss averaged over the
  TP x DP x CP group, then over DP);
- 0.19's forward_step takes the autoscaler's scale from `config.moe_grad_scale_func` when set.

`RouterLossConventions` says which a line does; `record_router_loss` and `moe_loss_scale` do it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

import torch

from . import compat

TOUCH = "exact MoE router losses (Megatron's MoE loss tracker and scaling)"


@dataclass(frozen=True)
class RouterLossConventions:
    """How one megatron-core line's TopKRouter scales and logs its losses."""

    per_token_tp_cp_factor: bool  # per-token losses also x the TP x CP size (0.19)
    seq_aux_tokens_per_sequence: bool  # seq_aux_loss's per-token count: per sequence (0.16)
    z_loss_logged_averaged: bool  # z-loss logged averaged over TP x DP x CP and DP (0.19)
    metrics_tracker: bool  # logs through moe_logging.get_moe_metrics_tracker (0.19)
    moe_grad_scale_func: bool  # forward_step prefers config.moe_grad_scale_func (0.19)


#: The lines whose router losses TeraPipe reproduces, each with its conventions.
ROUTER_LOSS_CONVENTIONS = {
    (0, 16): RouterLossConventions(per_token_tp_cp_factor=False, seq_aux_tokens_per_sequence=True,
                                   z_loss_logged_averaged=False, metrics_tracker=False,
                                   moe_grad_scale_func=False),
    (0, 18): RouterLossConventions(per_token_tp_cp_factor=False, seq_aux_tokens_per_sequence=True,
                                   z_loss_logged_averaged=False, metrics_tracker=True,
                                   moe_grad_scale_func=False),
    (0, 19): RouterLossConventions(per_token_tp_cp_factor=True, seq_aux_tokens_per_sequence=False,
                                   z_loss_logged_averaged=True, metrics_tracker=True,
                                   moe_grad_scale_func=True),
}

# 0.17's router.py is 0.16's plus multi-token prediction, which TeraPipe refuses
ROUTER_LOSS_CONVENTIONS[(0, 17)] = ROUTER_LOSS_CONVENTIONS[(0, 16)]

#: TransformerConfig fields read only on some lines (field -> the first line that has it).
LINE_CONFIG_FIELDS = {"moe_grad_scale_func": (0, 19)}


def router_loss_conventions() -> Optional[RouterLossConventions]:
    """This megatron-core line's conventions, or None where TeraPipe does not know them."""
    return ROUTER_LOSS_CONVENTIONS.get(compat.megatron_core_version()[:2])


def _conventions() -> RouterLossConventions:
    compat.require_tested(TOUCH)
    conventions = router_loss_conventions()
    if conventions is None:  # an untested line allowed by the environment: the newest's
        conventions = ROUTER_LOSS_CONVENTIONS[max(ROUTER_LOSS_CONVENTIONS)]
    return conventions


def metrics_recorder():
    """The function this line's router logs a loss with: 0.19's
    `get_moe_metrics_tracker().record` or 0.16's `moe_utils.save_to_aux_losses_tracker`."""
    if _conventions().metrics_tracker:
        try:
            logging = importlib.import_module("megatron.core.transformer.moe.moe_logging")
        except ImportError as exc:
            raise compat.moved(TOUCH, "megatron.core.transformer.moe.moe_logging is gone") from exc
        tracker = logging.get_moe_metrics_tracker()
        if not callable(getattr(tracker, "record", None)):
            raise compat.moved(TOUCH, "the MoE metrics tracker has no record()")
        return tracker.record
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not callable(getattr(moe_utils, "save_to_aux_losses_tracker", None)):
        raise compat.moved(TOUCH, "moe_utils.save_to_aux_losses_tracker is gone")
    return moe_utils.save_to_aux_losses_tracker


def record_router_loss(name: str, value: torch.Tensor, layer_number: int, num_layers: int,
                       reduce_group=None, avg_group=None, dp_average: bool = True) -> None:
    """Log one layer's loss in Megatron's MoE tracker with the reductions the router gives it:
    summed over `reduce_group`, averaged over `avg_group`, then over DP unless `dp_average` is
    False (0.16 averages over DP only after a reduce group, as its tracker does)."""
    recorder = metrics_recorder()
    if _conventions().metrics_tracker:
        recorder(name, value, layer_number, num_layers, reduce_group=reduce_group,
                 avg_group=avg_group, needs_dp_avg=dp_average)
    else:
        recorder(name, value, layer_number, num_layers, reduce_group=reduce_group,
                 avg_group=avg_group, reduce_group_has_dp=not dp_average)


def record_z_loss(router, value: torch.Tensor, num_layers: int) -> None:
    """Log the z-loss as this line's `apply_z_loss` does."""
    if _conventions().z_loss_logged_averaged:
        record_router_loss("z_loss", value, router.layer_number, num_layers,
                           avg_group=router.tp_dp_cp_group)
    else:
        record_router_loss("z_loss", value, router.layer_number, num_layers)


def per_token_factor(router) -> int:
    """What this line multiplies a per-token loss by beyond the rank's token count."""
    return router.tp_cp_group.size() if _conventions().per_token_tp_cp_factor else 1


def seq_aux_tokens_per_sequence() -> bool:
    """Whether seq_aux_loss's per-token count is per sequence (0.16) or per microbatch."""
    return _conventions().seq_aux_tokens_per_sequence


def moe_loss_scale(config, device: torch.device) -> torch.Tensor:
    """The scale forward_step gives MoEAuxLossAutoScaler before dividing by the microbatches:
    0.19's `config.moe_grad_scale_func()` when set, else `grad_scale_func(1)`, else 1."""
    scale_func = (getattr(config, "moe_grad_scale_func", None)
                  if _conventions().moe_grad_scale_func else None)
    if scale_func is not None:
        scale = torch.as_tensor(scale_func(), device=device)
        if scale.numel() != 1:
            raise ValueError(f"moe_grad_scale_func must return a scalar, got {scale.numel()} "
                             "elements (Megatron's forward_step refuses it too)")
        return scale.reshape(1)
    ones = torch.ones(1, device=device)
    return config.grad_scale_func(ones) if config.grad_scale_func is not None else ones


#: TopKRouter methods the MoE hooks replace per router (name -> the load-balancing type it
#: applies), checked to exist on the installed line.
SWITCH_METHODS = {"_apply_aux_loss": "aux_loss", "_apply_seq_aux_loss": "seq_aux_loss",
                  "_apply_global_aux_loss": "global_aux_loss"}
ROUTER_METHODS = ("routing", "apply_z_loss", *SWITCH_METHODS)
ROUTER_TOUCH = "exact MoE router losses (TopKRouter.routing, apply_z_loss, _apply_*aux_loss)"


def router_class() -> type:
    """TopKRouter, checked to have the methods the hooks replace."""
    compat.require_tested(ROUTER_TOUCH)
    from megatron.core.transformer.moe.router import TopKRouter

    for name in ROUTER_METHODS:
        if not callable(getattr(TopKRouter, name, None)):
            raise compat.moved(ROUTER_TOUCH, f"TopKRouter has no {name}")
    return TopKRouter


#: megatron-core lines whose router losses TeraPipe reproduces (ROUTER_LOSS_CONVENTIONS: how each
#: one scales and logs them).
EXACT_LOSS_LINES = tuple(ROUTER_LOSS_CONVENTIONS)


def line_problem() -> Optional[str]:
    """Why this megatron-core's router losses cannot run exactly under TeraPipe, or None."""
    version = compat.megatron_core_version()
    if version[:2] in EXACT_LOSS_LINES:
        return None
    lines = ", ".join(f"{a}.{b}.x" for a, b in ROUTER_LOSS_CONVENTIONS)
    return (f"TeraPipe reproduces the MoE load-balancing losses and the router z-loss of "
            f"megatron-core {lines} (each line scales and logs them its own way), not those of "
            f"megatron-core {compat.version_text(version)}: install one of those lines, drop "
            "--moe-aux-loss-coeff and --moe-z-loss-coeff (use --moe-router-enable-expert-bias "
            "for balancing), or use --pipeline-schedule 1f1b")
