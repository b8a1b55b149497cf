"""Capture audits of whole iterations on one stage (tests/test_graph_audit.py).

A one-stage GPT (PP=1, the local spec, one microbatch of 2 x 16 tokens) runs
`forward_backward_terapipe` with the default plan: one warm-up iteration (lazy set-up and the
buffer pool's first allocations), then two iterations under one CaptureAudit, whose findings
come back as text lines with the number of compute actions it saw. Megatron's loss runs in an
eager region (as a cell's graphs would leave it), except in "loss_in_the_graph".
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from megatron_terapipe.megatron.hooks.graph_scope import eager_outside_layers

from .host_cost import STEPS, _build
from .models import TinyGPT, make_batches

RUNS = {"deferred": dict(slices=4, step="three_value"),
        "in_every_cell": dict(slices=4, step="three_value", defer_wgrad=False),
        "deferred_k8": dict(slices=8, step="legacy"),
        "syncing_loss_func": dict(slices=4, step="syncing"),
        "loss_in_the_graph": dict(slices=4, step="three_value", loss_in_graph=True)}


def audit_one_stage(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core import parallel_state

    from megatron_terapipe import TeraPipePlan
    from megatron_terapipe.megatron.hooks.cpu import enable_cpu_mode
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe
    from megatron_terapipe.runtime.graph_audit import CaptureAudit, CaptureAuditError

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, 1)
    model_cfg = TinyGPT(num_layers=2, hidden_size=64)
    batches = make_batches(1, 2, model_cfg.seq_length, model_cfg.vocab_size)
    out: dict[str, Any] = {}
    for name, run in RUNS.items():
        model = _build(model_cfg, ddp=False)
        if not run.get("loss_in_graph"):
            eager_outside_layers(model)
        plan = TeraPipePlan.uniform(model_cfg.seq_length, run["slices"])
        if "defer_wgrad" in run:
            plan = TeraPipePlan(plan.seq_slices, defer_wgrad=run["defer_wgrad"])
        iteration = partial(forward_backward_terapipe, forward_step_func=STEPS[run["step"]],
                            model=[model], num_microbatches=1, seq_length=model_cfg.seq_length,
                            micro_batch_size=2, plan=plan)
        iteration(data_iterator=iter(batches))  # warm-up
        audit = CaptureAudit(torch.device("cpu"))
        with audit:
            iteration(data_iterator=iter(batches))
            audit.next_iteration()
            iteration(data_iterator=iter(batches))
        try:
            audit.check()
        except CaptureAuditError:
            pass
        out[name] = {"violations": list(dict.fromkeys(str(v) for v in audit.violations)),
                     "actions": audit.actions_seen}
    parallel_state.destroy_model_parallel()
    return out


def audit_pipeline(rank: int, world_size: int, runs: list[dict], tp: int = 1,
                   ddp: bool = False) -> dict[str, list[str]]:
    """Each run (order, deferral) on 2 pipeline stages (with `tp`-way tensor parallelism, and
    data parallelism over the other ranks, under Megatron's DDP when `ddp`), 2 microbatches of
    4 slices: this rank's findings over two audited iterations after a warm-up."""
    from megatron.core import parallel_state

    from megatron_terapipe import TeraPipePlan, configure
    from megatron_terapipe.megatron.hooks.cpu import enable_cpu_mode
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe
    from megatron_terapipe.runtime.graph_audit import CaptureAudit

    from .models import forward_step

    enable_cpu_mode()
    model_cfg = TinyGPT(num_layers=2, hidden_size=64)
    parallel_state.initialize_model_parallel(tp, 2)
    batches = make_batches(2, 2, model_cfg.seq_length, model_cfg.vocab_size)
    out: dict[str, list[str]] = {}
    for run in runs:
        config, model = _stage(model_cfg, tp, ddp)
        slices = TeraPipePlan.uniform(model_cfg.seq_length, 4).seq_slices
        configure(config, TeraPipePlan(slices, order=run["order"], defer_wgrad=run["defer_wgrad"]))
        iteration = partial(forward_backward_terapipe, forward_step_func=forward_step,
                            model=[model], num_microbatches=2,
                            seq_length=model_cfg.seq_length, micro_batch_size=2)
        iteration(data_iterator=iter(batches))  # warm-up
        audit = CaptureAudit(torch.device("cpu"))
        with audit:
            iteration(data_iterator=iter(batches))
            audit.next_iteration()
            iteration(data_iterator=iter(batches))
        audit.next_iteration()  # compares the two audited iterations
        out[f"{run['order']}, W {'on' if run['defer_wgrad'] else 'off'}"] = list(
            dict.fromkeys(str(v) for v in audit.violations))
    parallel_state.destroy_model_parallel()
    return out


def _stage(model_cfg: TinyGPT, tp: int, ddp: bool):
    """This rank's stage (Megatron's loss eager, as graphs leave it), under DDP when asked."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from .models import build_stage_model

    config, model = build_stage_model(model_cfg, tp, 2)
    eager_outside_layers(model)
    if ddp:
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        model.zero_grad_buffer()
    return config, model
