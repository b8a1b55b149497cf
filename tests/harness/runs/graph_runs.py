"""Capture audits of real runs (runtime/graphs/graph_audit.py) and cell-graph runs with a recording graph.

`audit_runs` trains one stage model per run (TP x PP x DP from the world size and the run's
tp/pp; Megatron DDP when DP > 1) on fresh batches every iteration, as training does, and audits
two iterations after a warm-up. A run may plant a violation in forward_step: "sync" (the loss
reads its token count on the host) or "address" (the loss reads a tensor made anew each
iteration outside the cell). Returns, per run, the violations as text, and a line if the buffer
pool allocated after the warm-up (the steady state must take every buffer from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..models import TinyGPT, build_stage_model, forward_step, make_batches
from ..process_groups import release_model_parallel


@dataclass(frozen=True)
class AuditRun:
    name: str
    tp: int = 1
    pp: int = 2
    order: str = "1f1b"
    defer_wgrad: bool = True
    slices: int = 4
    plant: Optional[str] = None  # "sync" or "address": a violation forward_step makes


def _planted_step(plant: Optional[str], state: dict) -> Callable:
    if plant is None:
        return forward_step

    def step(data_iterator, model):
        output, loss = forward_step(data_iterator, model)

        def planted(output_tensor):
            loss_sum, num_tokens, report = loss(output_tensor)
            if plant == "sync":
                num_tokens = int(num_tokens)
            elif plant == "address":
                loss_sum = loss_sum * state["scale"]
            return loss_sum, num_tokens, report
        return output, planted
    return step


def _model(model_cfg: TinyGPT, run: AuditRun, dp: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config, model = build_stage_model(model_cfg, run.tp, run.pp)
    if dp > 1:
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
    return model


def audit_one(run: AuditRun, world_size: int) -> list[str]:
    from megatron.core import parallel_state

    from megatron_terapipe import TeraPipePlan
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe
    from megatron_terapipe.runtime.graphs.graph_audit import audit_iterations

    dp = world_size // (run.tp * run.pp)
    parallel_state.initialize_model_parallel(run.tp, run.pp)
    model_cfg = TinyGPT(num_layers=2 * run.pp)
    model = _model(model_cfg, run, dp)
    plan = TeraPipePlan(TeraPipePlan.uniform(model_cfg.seq_length, run.slices).seq_slices,
                        order=run.order, defer_wgrad=run.defer_wgrad)
    state = {"iteration": 0}
    step = _planted_step(run.plant, state)

    def iteration() -> None:
        state["iteration"] += 1
        state["scale"] = torch.ones(())  # made anew outside every cell, each iteration
        seed = 100 * state["iteration"] + parallel_state.get_data_parallel_rank()
        batches = make_batches(3, 2, model_cfg.seq_length, model_cfg.vocab_size, seed=seed)
        forward_backward_terapipe(
            forward_step_func=step, data_iterator=iter(batches), model=[model],
            num_microbatches=3, seq_length=model_cfg.seq_length, micro_batch_size=2, plan=plan)

    iteration()  # warm-up: lazy set-up and the pool's first allocations
    allocated_after_warmup = _pool_allocations(model)
    report = audit_iterations(iteration, warmup=0)
    grown = _pool_allocations(model) - allocated_after_warmup
    del model, iteration  # the model holds its groups: their threads end when it goes
    release_model_parallel()
    assert report.ops_in_cells > 0 and report.cells, f"{run.name}: the audit saw no cell"
    found = [str(v) for v in report.violations]
    if grown:  # the steady state must take every buffer from the pool
        found.append(f"the buffer pool allocated {grown} tensors after warm-up")
    return found


def _pool_allocations(model) -> int:
    return sum(memory.pool.allocations for memory in model.__dict__["_terapipe_pools"].values())


def audit_runs(rank: int, world_size: int, runs: list[AuditRun]) -> dict[str, Any]:
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    return {run.name: audit_one(run, world_size) for run in runs}


def graph_runs(rank: int, world_size: int, iterations: int, defer_wgrad: bool) -> dict[str, Any]:
    """PP=world_size training with `configure(..., cuda_graphs=True)` and a recording graph
    factory: per iteration, the losses, the gradients, and what the graphs recorded."""
    from megatron.core import parallel_state

    from megatron_terapipe import TeraPipePlan, configure
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe
    from megatron_terapipe.runtime.graphs.cell_graphs import RecordingGraph

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    model_cfg = TinyGPT(num_layers=2 * world_size)
    config, model = build_stage_model(model_cfg, 1, world_size)
    plan = TeraPipePlan(TeraPipePlan.uniform(model_cfg.seq_length, 4).seq_slices,
                        defer_wgrad=defer_wgrad)
    graphs: list[RecordingGraph] = []
    configure(config, plan, cuda_graphs=True,
              graph_factory=lambda key: graphs.append(RecordingGraph(key)) or graphs[-1])
    batches = make_batches(3, 2, model_cfg.seq_length, model_cfg.vocab_size, seed=5)
    out: dict[str, Any] = {"iterations": []}
    for _ in range(iterations):
        model.zero_grad(set_to_none=False)  # graphs write where they captured
        calls_before = [g.calls for g in graphs]
        losses = forward_backward_terapipe(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=3, seq_length=model_cfg.seq_length, micro_batch_size=2)
        out["iterations"].append({
            "losses": [float(r["lm loss"][0]) for r in losses],
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "graphs": len(graphs), "replays": sum(g.replays for g in graphs),
            "new_calls": sum(g.calls for g in graphs) - sum(calls_before)})
    out["keys"] = [g.key for g in graphs]
    out["captured_ops"] = {g.key: len(g.ops) for g in graphs}
    release_model_parallel()
    return out

