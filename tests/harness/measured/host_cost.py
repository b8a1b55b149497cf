"""What one iteration costs the host, counted per run: host syncs and gradient accumulations.

A one-stage GPT (PP=1, one microbatch) runs `forward_backward_terapipe` with K uniform token
slices. Counted, per iteration:

- host syncs: `aten._local_scalar_dense`, what `.item()`, `float(t)` and `bool(t)` dispatch to
  (on a GPU each waits for the device), seen by a TorchDispatchMode;
- accumulations: calls of every parameter's post-accumulate-grad hook, i.e. gradients autograd
  accumulated into a parameter (each a separate add of a parameter-sized gradient, or a first
  write);
- under Megatron DDP: `add_` calls into a linear weight's main_grad (a GEMM's result added
  separately) and `addmm_` calls into one (the GEMM accumulating there itself).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..models import TinyGPT, forward_step, legacy_forward_step, make_batches, seed
from ..process_groups import release_model_parallel

_aten = torch.ops.aten


class _Counter(TorchDispatchMode):
    def __init__(self, main_grads: set[int]) -> None:
        super().__init__()
        self.main_grads = main_grads  # data pointers of linear weights' main_grad
        self.syncs = self.main_grad_adds = self.main_grad_gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _aten._local_scalar_dense.default:
            self.syncs += 1
        elif self.main_grads and args and isinstance(args[0], torch.Tensor):
            if args[0].data_ptr() in self.main_grads:
                if func.overloadpacket is _aten.add_:
                    self.main_grad_adds += 1
                elif func.overloadpacket is _aten.addmm_:
                    self.main_grad_gemms += 1
        return func(*args, **(kwargs or {}))


def _syncing_forward_step(data_iterator, model):
    """A forward_step whose loss_func reads its token count on the host once per call."""
    output, loss = forward_step(data_iterator, model)

    def read_on_host(output_tensor):
        loss_sum, num_tokens, report = loss(output_tensor)
        return loss_sum, int(num_tokens), report

    return output, read_on_host


STEPS = {"three_value": forward_step, "legacy": legacy_forward_step,
         "syncing": _syncing_forward_step}


def _build(model_cfg: TinyGPT, ddp: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_terapipe.megatron.model.layer_specs import get_gpt_layer_spec

    seed(model_cfg.seed)
    config = model_cfg.config()
    model = model_cfg.build(config, get_gpt_layer_spec())
    if ddp:
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    return model


def count_host_cost(rank: int, world_size: int, slice_counts: list[int], runs: list[dict]
                    ) -> dict[str, Any]:
    """Per run (plan keywords, step name, ddp) and per K: syncs, accumulations (all, and per
    parameter at most), main_grad adds and GEMMs of linear weights. Also the parameter count."""
    from megatron.core import parallel_state

    from megatron_terapipe import TeraPipePlan
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, 1)
    model_cfg = TinyGPT(num_layers=2, hidden_size=64)
    batches = make_batches(1, 2, model_cfg.seq_length, model_cfg.vocab_size)
    out: dict[str, Any] = {}
    for run in runs:
        model = _build(model_cfg, run.get("ddp", False))
        params = [p for p in model.parameters() if p.requires_grad]
        calls = {id(p): 0 for p in params}
        for p in params:
            p.register_post_accumulate_grad_hook(lambda t: calls.__setitem__(id(t), calls[id(t)] + 1))
        main_grads = {p.main_grad.data_ptr() for p in params
                      if p.dim() == 2 and hasattr(p, "main_grad") and "embedding" not in _name(model, p)}
        for k in slice_counts:
            plan = TeraPipePlan.uniform(model_cfg.seq_length, k)
            if "defer_wgrad" in run:
                plan = TeraPipePlan(plan.seq_slices, defer_wgrad=run["defer_wgrad"])
            iteration = partial(forward_backward_terapipe, forward_step_func=STEPS[run["step"]],
                                model=[model], num_microbatches=1,
                                seq_length=model_cfg.seq_length, micro_batch_size=2, plan=plan)
            iteration(data_iterator=iter(batches))  # warm-up: lazy set-up is not per iteration
            for key in calls:
                calls[key] = 0
            with _Counter(main_grads) as counter:
                iteration(data_iterator=iter(batches))
            out[(run["name"], k)] = {
                "syncs": counter.syncs, "accumulations": sum(calls.values()),
                "most_per_param": max(calls.values()), "main_grad_adds": counter.main_grad_adds,
                "main_grad_gemms": counter.main_grad_gemms, "params": len(params),
                "linear_weights": len(main_grads)}
    release_model_parallel()
    return out


def _name(model: torch.nn.Module, param: torch.Tensor) -> str:
    return next(n for n, p in model.named_parameters() if p is param)
