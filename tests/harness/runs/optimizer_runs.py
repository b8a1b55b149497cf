"""Training steps with Megatron's distributed optimizer: TeraPipe against Megatron's own pipeline
schedule on the same layout, weights and batches, iteration by iteration.

Each side builds this rank's model chunks from the full model's weights, wraps them in Megatron's
DDP with `use_distributed_optimizer=True` (gradients reduce-scattered over the data-parallel
group, parameters all-gathered after each step; or without it, `distributed_optimizer=False`),
bf16 models in a Float16Module with fp32 gradient buffers as Megatron-LM's `--bf16` has them,
and builds Megatron's optimizer with `get_megatron_optimizer`, then runs a few iterations as
Megatron-LM's `train_step` does (zero the
grad buffers, one forward-backward, `optimizer.step()`; Adam, the one optimizer Megatron's
distributed optimizer takes: torch's AdamW on CPU), with the forward pre-hooks of an
overlapped parameter gather off for the first iteration and on after it, as Megatron-LM's
`train` sets them. The reference is `forward_backward_pipelining_without_interleaving` on one
chunk and `..._with_interleaving` on V chunks; the other side is `forward_backward_terapipe`.

Per iteration each side records its reported losses, the gradient norm the optimizer's step
returns (over every rank) and every parameter's main_grad after the schedule (the
reduce-scattered buffers: the rank's own shard holds the data-parallel sum, the rest its local
gradients); after the last step every parameter, all-gathered. Both sides' float32 copies go
back to the test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..cases import baseline
from ..compare import chunk_grads, global_name, load_full_state, report_values, unwrap
from ..models import TinyGPT, forward_step, in_precision, make_batches, seed
from ..process_groups import release_model_parallel


@dataclass(frozen=True)
class OptimizerCase:
    """Iterations with Megatron's distributed optimizer, TeraPipe against Megatron's schedule."""

    name: str
    plan: Any  # TeraPipePlan; its virtual_stages are the chunks per rank
    pp: int = 2
    tp: int = 1
    num_microbatches: int = 4
    micro_batch_size: int = 2
    iterations: int = 3
    model: TinyGPT = field(default_factory=TinyGPT)
    lr: float = 1e-3
    clip_grad: float = 0.0  # clip by the total norm above this (0: no clipping)
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    distributed_optimizer: bool = True  # False: Megatron's other optimizers (bf16: its 16-bit one)
    # what harness.baseline reads of a case (the full model's weights come from it)
    legacy_loss: bool = False
    forward_only: bool = False
    # TeraPipe's side runs a MeasuredChoice of Megatron's schedule and `plan` (1 trial each):
    # Megatron, TeraPipe, Megatron, TeraPipe, a runoff when within 5%, then the faster
    switch: bool = False

    @property
    def chunks(self) -> int:
        return self.plan.virtual_stages


def _chunks(case: OptimizerCase, full_state: dict, terapipe: bool):
    """This rank's chunks (Megatron's local spec for the reference, the slice-aware spec for
    TeraPipe) with the full model's weights, as Megatron-LM builds them."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_terapipe.megatron.model.layer_specs import get_gpt_layer_spec

    V = case.chunks
    config = case.model.config(case.tp, case.pp)
    if V > 1:
        config.virtual_pipeline_model_parallel_size = V
        config.microbatch_group_size_per_vp_stage = case.pp
    spec = get_gpt_layer_spec() if terapipe else get_gpt_layer_local_spec()
    seed(case.model.seed + 1)  # different init: the weights must come from the copy below
    chunks = []
    for c in range(V):
        vp = c if V > 1 else None
        chunk = case.model.build(
            config, spec, vp_stage=vp,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=V == 1, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=V == 1, vp_stage=vp))
        load_full_state(chunk, full_state)
        chunks.append(in_precision(config, chunk))  # bf16: a Float16Module, as Megatron-LM wraps
    return config, chunks


def _train_setup(case: OptimizerCase, config, chunks):
    """Megatron DDP for the distributed optimizer on every chunk (bucketing on the first only,
    as Megatron-LM wraps them), Megatron's optimizer, and the config hooks Megatron-LM sets."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = case.model.bf16
    # bf16: gradients accumulate and reduce in fp32, as Megatron-LM's --bf16 sets
    # (accumulate_allreduce_grads_in_fp32)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=case.distributed_optimizer, grad_reduce_in_fp32=bf16,
        overlap_grad_reduce=case.overlap_grad_reduce,
        overlap_param_gather=case.overlap_param_gather)
    chunks = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=c > 0)
              for c, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=case.lr, weight_decay=0.01,
                        clip_grad=case.clip_grad,
                        use_distributed_optimizer=case.distributed_optimizer, bf16=bf16,
                        params_dtype=torch.bfloat16 if bf16 else torch.float32),
        chunks)

    def one_or_list(functions: list):
        return functions[0] if len(functions) == 1 else functions

    if case.overlap_grad_reduce:
        config.no_sync_func = one_or_list([chunk.no_sync for chunk in chunks])
        config.grad_sync_func = one_or_list([chunk.start_grad_sync for chunk in chunks])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return chunks, optimizer, one_or_list([chunk.start_param_sync for chunk in chunks])


def _schedule(case: OptimizerCase, config, terapipe: bool):
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving,
        forward_backward_pipelining_without_interleaving)

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe

    megatron = forward_backward_pipelining_without_interleaving
    if case.chunks > 1 and (case.switch or not terapipe):
        # on 2 ranks Megatron needs overlapped P2P (unbatched: each send and receive its own call)
        config.overlap_p2p_comm, config.batch_p2p_comm = case.pp == 2, case.pp > 2
        megatron = forward_backward_pipelining_with_interleaving
    if not terapipe:
        return megatron
    configure(config, case.plan)
    if case.switch:
        from megatron_terapipe import MeasuredChoice, TrialCandidate

        choice = MeasuredChoice([TrialCandidate("Megatron", None),
                                 TrialCandidate("TeraPipe", case.plan)], trials=1,
                                log=lambda line: None)
        return choice.wrap(megatron, forward_backward_terapipe)
    return forward_backward_terapipe


def _params(chunks) -> dict[str, torch.Tensor]:
    return {global_name(unwrap(chunk), name): param.detach().float().clone()
            for chunk in chunks for name, param in unwrap(chunk).named_parameters()}


def train(case: OptimizerCase, full_state: dict, batches: list, terapipe: bool) -> dict[str, Any]:
    """`case.iterations` training steps on one side; `batches[i]` is iteration i's list."""
    config, chunks = _chunks(case, full_state, terapipe)
    chunks, optimizer, param_sync_func = _train_setup(case, config, chunks)
    schedule = _schedule(case, config, terapipe)
    record: dict[str, Any] = {"losses": [], "grads": [], "grad_norms": [], "start": _params(chunks),
                              "optimizers": [type(o).__name__ for o in
                                             getattr(optimizer, "chained_optimizers", [optimizer])]}
    for i, iteration_batches in enumerate(batches):
        overlapped_gather = case.overlap_param_gather and i > 0
        for chunk in chunks:  # Megatron-LM: hooks off for the first iteration, then on
            if overlapped_gather and i == 1:
                chunk.enable_forward_pre_hook()
            elif case.overlap_param_gather and i == 0:
                chunk.disable_forward_pre_hook(param_sync=False)
            chunk.zero_grad_buffer()
        config.param_sync_func = param_sync_func if overlapped_gather else None
        optimizer.zero_grad()
        losses = schedule(forward_step_func=forward_step,
                          data_iterator=[iter(iteration_batches) for _ in chunks],
                          model=chunks, num_microbatches=case.num_microbatches,
                          seq_length=case.model.seq_length,
                          micro_batch_size=case.micro_batch_size)
        record["grads"].append(chunk_grads(chunks))
        choice = getattr(schedule, "measured_choice", None)
        if choice is not None:  # which candidate ran: the last one timed, or the kept one
            record.setdefault("ran", []).append(choice.last_run)
        ok, grad_norm, _ = optimizer.step()  # the norm over all ranks, clipping or not
        assert ok, f"{case.name}: the optimizer skipped iteration {i}"
        record["grad_norms"].append(float(grad_norm))
        record["losses"].append(report_values(losses) if losses else [])
    if case.overlap_param_gather:
        for chunk in chunks:  # Megatron-LM's end of training: the last gather, finished
            chunk.disable_forward_pre_hook(param_sync=True)
    record["params"] = _params(chunks)
    del chunks, optimizer, config
    return record


def run_optimizer_case(rank: int, world_size: int, case: OptimizerCase) -> dict[str, Any]:
    """Worker body: Megatron's schedule, then TeraPipe, from the same weights on the same
    batches (this data-parallel rank's share of each iteration's)."""
    from megatron.core import parallel_state

    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    dp = world_size // (case.tp * case.pp)
    per_iteration = case.num_microbatches * dp
    batches = make_batches(case.iterations * per_iteration, case.micro_batch_size,
                           case.model.seq_length, case.model.vocab_size, seed=11)
    _, _, full_state = baseline(case, batches[:per_iteration])  # the full model's weights
    V = case.chunks
    parallel_state.initialize_model_parallel(
        case.tp, case.pp, virtual_pipeline_model_parallel_size=V if V > 1 else None)
    first = parallel_state.get_data_parallel_rank() * case.num_microbatches
    mine = [batches[i * per_iteration + first:i * per_iteration + first + case.num_microbatches]
            for i in range(case.iterations)]
    result = {"rank": rank, "last_stage": parallel_state.is_pipeline_last_stage(),
              "megatron": train(case, full_state, mine, terapipe=False),
              "terapipe": train(case, full_state, mine, terapipe=True)}
    release_model_parallel()
    return result


def run_optimizer_cases(rank: int, world_size: int, cases: list) -> dict[str, Any]:
    return {case.name: run_optimizer_case(rank, world_size, case) for case in cases}
