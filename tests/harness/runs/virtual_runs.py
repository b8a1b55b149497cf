"""The equivalence experiment on virtual stages: a TeraPipe plan with V model chunks per rank
against Megatron's no-pipelining run on the full model (K * V chunks of layers), or against
Megatron's own interleaved 1F1B on the same chunks, gradient by gradient and loss by loss.

Each rank builds its V chunks as Megatron builds them for its interleaved schedule
(GPTModel(..., vp_stage=c) under config.virtual_pipeline_model_parallel_size = V: chunk c of
rank k holds the layers of virtual stage c * K + k) and loads the full model's weights by each
layer's global number. `harness.check_case` checks the results, as for one chunk per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..cases import baseline
import torch

from ..compare import FP32, Tolerance, chunk_grads, grad_pairs, load_full_state, report_values
from ..models import TinyGPT, forward_step, make_batches, seed
from ..process_groups import release_model_parallel


@dataclass(frozen=True)
class VirtualCase:
    """One TeraPipe run on virtual stages, compared with `reference` on every rank:
    "no_pipelining" (the full model, Megatron's local spec) or "interleaved" (Megatron's
    interleaved 1F1B on chunks with the same weights)."""

    name: str
    plan: Any  # TeraPipePlan with virtual_stages = V
    pp: int = 2
    tp: int = 1
    num_microbatches: int = 3
    micro_batch_size: int = 2
    model: TinyGPT = field(default_factory=lambda: TinyGPT(num_layers=4))
    ddp: bool = False
    overlap_grad_reduce: bool = False
    grad_sync_func: bool = False  # config.grad_sync_func per chunk, as Megatron-LM sets it
    transport: Optional[str] = None
    deallocate_outputs: bool = False
    scatter_gather: bool = False  # config.terapipe.scatter_gather: messages in TP parts
    packed: bool = False  # documents packed in each row (models.packed_documents)
    reference: str = "no_pipelining"
    tolerance: Tolerance = FP32
    # what harness.check_case reads of every case
    forward_only: bool = False
    legacy_loss: bool = False

    @property
    def chunks(self) -> int:
        return self.plan.virtual_stages

    @property
    def v_shape(self) -> bool:
        """Chunks in a V (megatron_terapipe.v_chunk_roles, place_in_v): the loss on rank 0."""
        return self.plan.virtual_placement == "v"

    def holds_loss(self, rank: int) -> bool:
        """Whether pipeline rank `rank` runs the loss (reports the losses)."""
        from megatron_terapipe.schedule.routes import loss_stage

        return rank == loss_stage(self.plan, self.pp)


def build_chunks(case: VirtualCase, full_state: dict, ddp: bool):
    """This rank's V model chunks with the full model's weights (and Megatron DDP per chunk,
    as Megatron-LM wraps them: bucketing only on the first); returns (config, chunks)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel

    from megatron_terapipe import place_in_v, v_chunk_roles
    from megatron_terapipe.megatron.model.layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_spec

    seed(case.model.seed + 1)  # different init: the weights must come from the copy below
    config = case.model.config(case.tp, case.pp)
    config.virtual_pipeline_model_parallel_size = case.chunks
    config.microbatch_group_size_per_vp_stage = case.pp
    chunks = []
    rank, K = parallel_state.get_pipeline_model_parallel_rank(), case.pp
    for c in range(case.chunks):
        roles = (v_chunk_roles(c, rank, K) if case.v_shape else
                 (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=c),
                  parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=c)))
        # sequence parallelism: the block spec, whose norms run sequence-parallel on CPU
        spec = (get_gpt_decoder_block_spec(config, vp_stage=c) if case.model.sequence_parallel
                else get_gpt_layer_spec())
        chunk = GPTModel(
            config, spec, vocab_size=case.model.vocab_size,
            max_sequence_length=case.model.seq_length,
            pre_process=roles[0], post_process=roles[1],
            position_embedding_type=case.model.position_embedding_type,
            share_embeddings_and_output_weights=not case.model.untie, vp_stage=c)
        if case.v_shape:
            place_in_v(chunk, c, rank, K)  # chunk 1: virtual stage 2K - 1 - k, not K + k
        load_full_state(chunk, full_state)
        chunks.append(chunk)
    if ddp:
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=case.overlap_grad_reduce,
                                                   use_distributed_optimizer=False)
        chunks = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=c > 0)
                  for c, chunk in enumerate(chunks)]
        config.no_sync_func = [chunk.no_sync for chunk in chunks]
        if case.grad_sync_func:
            config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
        config.finalize_model_grads_func = finalize_model_grads
        for chunk in chunks:
            chunk.zero_grad_buffer()
    return config, chunks


def megatron_interleaved(case: VirtualCase, full_state: dict, batches: list) -> tuple[list, dict]:
    """Megatron's forward_backward_pipelining_with_interleaving on chunks with the same
    weights: (its loss reports, its gradients by global name)."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving)

    config, chunks = build_chunks(case, full_state, ddp=case.ddp)
    # on 2 ranks Megatron needs overlapped P2P (unbatched: each send and receive its own call)
    config.overlap_p2p_comm, config.batch_p2p_comm = case.pp == 2, case.pp > 2
    losses = forward_backward_pipelining_with_interleaving(
        forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
        model=chunks, num_microbatches=case.num_microbatches,
        seq_length=case.model.seq_length, micro_batch_size=case.micro_batch_size)
    grads = chunk_grads(chunks)
    del chunks, config
    return losses, grads


def run_virtual_case(rank: int, world_size: int, case: VirtualCase) -> dict[str, Any]:
    """Worker body: the reference, then TeraPipe on the same weights and data."""
    from megatron.core import parallel_state

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe

    enable_cpu_mode()
    dp = world_size // (case.tp * case.pp)
    batches = make_batches(case.num_microbatches * dp, case.micro_batch_size,
                           case.model.seq_length, case.model.vocab_size, seed=7,
                           packed=case.packed)
    ref_losses, ref_grads, full_state = baseline(case, batches)
    parallel_state.initialize_model_parallel(
        case.tp, case.pp, virtual_pipeline_model_parallel_size=case.chunks)
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = slice(dp_rank * case.num_microbatches, (dp_rank + 1) * case.num_microbatches)
    if case.reference == "interleaved":
        ref_losses, ref_grads = megatron_interleaved(case, full_state, batches[mine])
        ref_losses = [None] * dp_rank * case.num_microbatches + list(ref_losses)
    config, chunks = build_chunks(case, full_state, ddp=case.ddp)
    configure(config, case.plan)
    config.terapipe.transport = case.transport
    config.terapipe.scatter_gather = case.scatter_gather
    config.deallocate_pipeline_outputs = case.deallocate_outputs
    records: list = []
    losses = forward_backward_terapipe(
        forward_step_func=forward_step, data_iterator=[iter(batches[mine]) for _ in chunks],
        model=chunks, num_microbatches=case.num_microbatches,
        seq_length=case.model.seq_length, micro_batch_size=case.micro_batch_size,
        on_run=records.append)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    result = {"rank": rank, "last_stage": case.holds_loss(pp_rank),
              **_receives(case, records[-1])}
    if result["last_stage"]:
        result["losses"] = report_values(losses)
        result["ref_losses"] = report_values(ref_losses[mine])
    grads = chunk_grads(chunks)
    if case.reference == "interleaved":
        refs = {name: torch.zeros_like(grads[name]) if ref is None else ref
                for name, ref in ref_grads.items()}
    else:
        refs = {name: ref for chunk in chunks for name, (_, ref) in grad_pairs(chunk, ref_grads).items()}
    result["grads"] = {name: (grad, refs[name]) for name, grad in grads.items()}
    del chunks, config
    release_model_parallel()
    return result


def _receives(case: VirtualCase, record) -> dict[str, Any]:
    """The RunRecord's counts, and the receives the torch transport must have made: an input
    per cell and chunk (but the model's first virtual stage) and a gradient per cell and
    chunk (but its last)."""
    from megatron.core import parallel_state

    cells = record.schedule.num_microbatches * record.schedule.plan.num_cells
    V, rank = case.chunks, parallel_state.get_pipeline_model_parallel_rank()
    first, last = rank == 0, rank == case.pp - 1
    # a V: rank 0 runs the embedding and the loss, the last rank's turn is no message
    inputs = cells * V - cells * (first + (case.v_shape and last))
    gradients = cells * V - cells * ((first if case.v_shape else last) + (case.v_shape and last))
    return {"deferred_wgrads": record.deferred_wgrads, "receives": record.receives,
            "receives_posted_early": record.receives_posted_early,
            "received_elements": record.received_elements,
            "outputs_deallocated": record.outputs_deallocated,
            "cells": cells * V - cells * (case.holds_loss(rank) + (case.v_shape and last)),
            "expected_receives": inputs + gradients}


def run_virtual_cases(rank: int, world_size: int, cases: list) -> dict[str, Any]:
    return {case.name: run_virtual_case(rank, world_size, case) for case in cases}
