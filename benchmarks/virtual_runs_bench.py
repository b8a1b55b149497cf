"""Timed runs on virtual pipeline stages for bench_virtual_cpu.py: Megatron's 1F1B on one model
chunk per stage, Megatron's interleaved 1F1B on V chunks per stage, and TeraPipe plans on either,
all on the same weights and batches, interleaved round by round in the same processes.

Each stage process (harness.spawn) builds the full model once (float32 weights from the model's
seed), then its one-chunk stage (harness.build_stage_model) and its V chunks as Megatron builds
them for its interleaved schedule (harness.virtual_runs.build_chunks: GPTModel(...,
vp_stage=c) under config.virtual_pipeline_model_parallel_size = V), both loaded with those
weights by each layer's global number. Megatron's module-level virtual pipeline size is set for
the rows on chunks and cleared for the one-chunk rows, as each would run on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from harness import TinyGPT
from megatron_terapipe.plan import TeraPipePlan

MEGATRON_1F1B, MEGATRON_INTERLEAVED, TERAPIPE = "megatron_1f1b", "megatron_interleaved", "terapipe"


@dataclass(frozen=True)
class Row:
    """One timed configuration: which schedule, on how many model chunks per stage."""

    label: str
    schedule: str  # MEGATRON_1F1B, MEGATRON_INTERLEAVED or TERAPIPE
    chunks: int = 1
    plan: Optional[TeraPipePlan] = None  # TeraPipe's plan (virtual_stages == chunks)


@dataclass
class VirtualSpeedCase:
    model: TinyGPT
    num_microbatches: int
    rounds: int
    chunks: int  # V of the rows on chunks
    rows: list[Row] = field(default_factory=list)


def full_model_state(model_cfg: TinyGPT) -> dict:
    """The whole model's float32 weights from its seed (every rank builds the same)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from harness import release_model_parallel, unwrap
    from harness.models import seed

    parallel_state.initialize_model_parallel(1, 1)
    seed(model_cfg.seed)
    model = model_cfg.build(model_cfg.config(), get_gpt_layer_local_spec(**model_cfg.spec_kwargs))
    state = {k: v.detach().clone().float() for k, v in unwrap(model).named_parameters()}
    del model
    release_model_parallel()
    return state


def _use_virtual(chunks: int) -> None:
    """Megatron's module-level virtual pipeline size for a run on `chunks` chunks per stage."""
    from megatron.core import parallel_state

    parallel_state.set_virtual_pipeline_model_parallel_world_size(chunks if chunks > 1 else None)
    parallel_state.set_virtual_pipeline_model_parallel_rank(0 if chunks > 1 else None)


def build_models(case: VirtualSpeedCase, world_size: int) -> dict[int, list]:
    """{1: [the stage], V: its V chunks}, all with the same full model's weights."""
    from megatron.core import parallel_state

    from harness import build_stage_model, load_full_state
    from harness.virtual_runs import VirtualCase, build_chunks

    state = full_model_state(case.model)
    parallel_state.initialize_model_parallel(
        1, world_size, virtual_pipeline_model_parallel_size=case.chunks)
    _use_virtual(1)
    _, stage = build_stage_model(case.model, 1, world_size)
    load_full_state(stage, state)
    _use_virtual(case.chunks)
    shape = VirtualCase("bench", TeraPipePlan([case.model.seq_length], virtual_stages=case.chunks),
                        pp=world_size, model=case.model)
    config, chunks = build_chunks(shape, state, ddp=False)
    # Megatron's interleaved schedule on 2 ranks needs overlapped, unbatched P2P (as
    # harness.virtual_runs.megatron_interleaved sets it); TeraPipe's torch transport ignores both.
    config.overlap_p2p_comm, config.batch_p2p_comm = world_size == 2, world_size > 2
    return {1: [stage], case.chunks: chunks}


def _runner(case: VirtualSpeedCase, models: dict[int, list], batches: list, runs: list):
    """run(row) -> the losses of one iteration of the row's schedule on its model chunks."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving,
        forward_backward_pipelining_without_interleaving)

    from harness import forward_step
    from megatron_terapipe import forward_backward_terapipe

    common = dict(forward_step_func=forward_step, num_microbatches=case.num_microbatches,
                  seq_length=case.model.seq_length, micro_batch_size=1)

    def run(row: Row) -> list:
        chunks = models[row.chunks]
        _use_virtual(row.chunks)
        if row.schedule == MEGATRON_1F1B:
            return forward_backward_pipelining_without_interleaving(
                data_iterator=iter(batches), model=chunks, **common)
        iterators = [iter(batches) for _ in chunks] if row.chunks > 1 else iter(batches)
        if row.schedule == MEGATRON_INTERLEAVED:
            return forward_backward_pipelining_with_interleaving(
                data_iterator=iterators, model=chunks, **common)
        return forward_backward_terapipe(data_iterator=iterators, model=chunks, plan=row.plan,
                                         on_run=runs.append, **common)

    return run


def _zero_grads(chunks: list) -> None:
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)


def virtual_speed_worker(rank: int, world_size: int, case: VirtualSpeedCase) -> dict:
    """Every row of `case`: one warm-up iteration (its losses kept, on the last stage), then
    `rounds` interleaved rounds, the order rotating every round; wall seconds per run, and for
    TeraPipe rows this stage's busy seconds (its cells' spans, "busy:" + label)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from harness import make_batches, release_model_parallel, report_values
    from megatron_terapipe.megatron.platform.cpu import enable_cpu_mode, pin_to_core

    enable_cpu_mode()
    pin_to_core(rank, world_size)  # one core per stage, as one GPU per rank on GPUs
    batches = make_batches(case.num_microbatches, 1, case.model.seq_length,
                           case.model.vocab_size, masked_rows=False)
    models = build_models(case, world_size)
    last_stage = parallel_state.is_pipeline_last_stage()
    runs: list = []  # TeraPipe's run records
    run = _runner(case, models, batches, runs)
    out: dict = {"last_stage": last_stage}
    for row in case.rows:
        out[row.label] = []
        losses = run(row)  # warm-up: allocator, connections, TeraPipe's schedule and buffers
        out["losses:" + row.label] = report_values(losses) if last_stage else None
        _zero_grads(models[row.chunks])
        if row.schedule == TERAPIPE:
            out["busy:" + row.label] = []
    for round_ in range(case.rounds):
        # Rotate the order every round (as pipeline_runs.speed_worker does), so each row
        # follows each other one about equally often.
        shift = round_ % len(case.rows)
        for row in case.rows[shift:] + case.rows[:shift]:
            _zero_grads(models[row.chunks])
            dist.barrier()
            start = time.perf_counter()
            run(row)
            dist.barrier()
            out[row.label].append(time.perf_counter() - start)
            if row.schedule == TERAPIPE:
                out["busy:" + row.label].append(sum(e.end - e.start for e in runs[-1].events))
    del models
    release_model_parallel()
    return out


def loss_difference(losses: list, reference: list) -> float:
    """Largest relative difference of the summed loss of any microbatch (report [sum, count])."""
    worst = 0.0
    for got, ref in zip(losses, reference):
        worst = max(worst, abs(got[0] - ref[0]) / max(abs(ref[0]), 1e-12))
    return worst

