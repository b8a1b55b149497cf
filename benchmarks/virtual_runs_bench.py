"""Timed runs on virtual pipeline stages for bench_virtual_cpu.py: Megatron's 1F1B on one model
chunk per stage, Megatron's interleaved 1F1B on V chunks per stage, and TeraPipe plans on either,
all on the same weights and batches, interleaved round by round in the same processes.

Each stage process (harness.spawn) builds the full model once (float32 weights from the model's
seed), then its one-chunk stage (harness.build_stage_model) and its V chunks as Megatron builds
them for its interleaved schedule (harness.runs.virtual_runs.build_chunks: GPTModel(...,
vp_stage=c) under config.virtual_pipeline_model_parallel_size = V), both loaded with those
weights by each layer's global number. Megatron's module-level virtual pipeline size is set for
the rows on chunks and cleared for the one-chunk rows, as each would run on its own.

Where (`VirtualSpeedCase.device`): on CPU one pinned core per stage; on one GPU shared by the
stages under CUDA MPS (`mps`, each process its SM share, models in the model's precision).
`host_staged`: every row moves its activations through host memory and gloo, as
bench_gpu_pipeline.py's rows do under MPS: Megatron's schedules and TeraPipe on one chunk
through host_staged.HostStagedP2PCommunicator (TeraPipe's transport "megatron" over it),
TeraPipe on chunks through its torch transport staged through the host (transport "host": on
the ring of chunks TeraPipe's sends must not wait, which the communicator's calls do).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

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

    @property
    def layout(self):
        """Which models the row runs on: its chunk count, or "v" for chunks in a V."""
        in_a_v = self.plan is not None and self.plan.virtual_placement == "v"
        return "v" if in_a_v else self.chunks

    def holds_loss(self, pp_rank: int, num_stages: int) -> bool:
        """Whether pipeline rank `pp_rank` reports the row's losses (a V's: rank 0)."""
        from megatron_terapipe.schedule.routes import loss_stage

        return pp_rank == (num_stages - 1 if self.plan is None else
                           loss_stage(self.plan, num_stages))


@dataclass
class VirtualSpeedCase:
    model: TinyGPT
    num_microbatches: int
    rounds: int
    chunks: int  # V of the rows on chunks
    rows: list[Row] = field(default_factory=list)
    device: str = "cpu"
    host_staged: bool = False
    mps: bool = False


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


def build_models(case: VirtualSpeedCase, world_size: int) -> tuple[dict, dict]:
    """{1: [the stage], V: its V chunks, "v": 2 chunks in a V where a row runs them}, all with
    the same full model's weights, on the case's device in the model's precision; and each
    one's config."""
    from megatron.core import parallel_state

    from harness import build_stage_model, in_precision, load_full_state, to_device
    from harness.runs.virtual_runs import VirtualCase, build_chunks

    state = full_model_state(case.model)
    parallel_state.initialize_model_parallel(
        1, world_size, virtual_pipeline_model_parallel_size=case.chunks)
    _use_virtual(1)
    stage_config, stage = build_stage_model(case.model, 1, world_size)
    load_full_state(stage, state)
    _use_virtual(case.chunks)
    shape = VirtualCase("bench", TeraPipePlan([case.model.seq_length], virtual_stages=case.chunks),
                        pp=world_size, model=case.model)
    config, chunks = build_chunks(shape, state, ddp=False)
    # Megatron's interleaved schedule on 2 ranks needs overlapped, unbatched P2P (as
    # harness.runs.virtual_runs.megatron_interleaved sets it); TeraPipe's torch transport ignores both.
    config.overlap_p2p_comm, config.batch_p2p_comm = world_size == 2, world_size > 2
    configs, built = {1: stage_config, case.chunks: config}, {1: [stage], case.chunks: chunks}
    if any(row.layout == "v" for row in case.rows):  # rank 0: the embedding and the loss
        in_a_v = replace(shape, plan=replace(shape.plan, virtual_stages=2, virtual_placement="v"))
        configs["v"], built["v"] = build_chunks(in_a_v, state, ddp=False)
    on_device = {n: [in_precision(configs[n], to_device(m, case.device)) for m in models]
                 for n, models in built.items()}
    return on_device, configs


def _transfers(case: VirtualSpeedCase, configs: dict) -> dict[int, dict]:
    """Per chunk count, the communicator arguments every schedule of those rows takes: with
    `host_staged`, one HostStagedP2PCommunicator per config, TeraPipe's transport over it."""
    if not case.host_staged:
        return {n: {} for n in configs}
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from host_staged import HostStagedP2PCommunicator
    from megatron_terapipe import TeraPipeConfig

    group = parallel_state.get_pipeline_model_parallel_group()
    out = {}
    for n, config in configs.items():
        config.terapipe = replace(getattr(config, "terapipe", None) or TeraPipeConfig(),
                                  transport="megatron" if n == 1 else "host")
        out[n] = {"p2p_communicator": HostStagedP2PCommunicator(group, config),
                  "pg_collection": ProcessGroupCollection.use_mpu_process_groups()}
    return out


def _staged(transfers: dict) -> int:
    """Messages the row's host-staged communicator has moved so far (0 without one)."""
    communicator = transfers.get("p2p_communicator")
    return 0 if communicator is None else communicator.transfers


def _runner(case: VirtualSpeedCase, models: dict[int, list], batches: list, runs: list,
            transfers: dict[int, dict]):
    """run(row) -> the losses of one iteration of the row's schedule on its model chunks."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving,
        forward_backward_pipelining_without_interleaving)

    from harness import forward_step
    from megatron_terapipe import forward_backward_terapipe

    common = dict(forward_step_func=forward_step, num_microbatches=case.num_microbatches,
                  seq_length=case.model.seq_length, micro_batch_size=1)

    def run(row: Row) -> list:
        chunks, args = models[row.layout], dict(common, **transfers[row.layout])
        _use_virtual(row.chunks)
        if row.schedule == MEGATRON_1F1B:
            return forward_backward_pipelining_without_interleaving(
                data_iterator=iter(batches), model=chunks, **args)
        iterators = [iter(batches) for _ in chunks] if row.chunks > 1 else iter(batches)
        if row.schedule == MEGATRON_INTERLEAVED:
            return forward_backward_pipelining_with_interleaving(
                data_iterator=iterators, model=chunks, **args)
        return forward_backward_terapipe(data_iterator=iterators, model=chunks, plan=row.plan,
                                         on_run=runs.append, **args)

    return run


def _rows_runner(case: VirtualSpeedCase, world_size: int, runs: list):
    """The case's models (build_models), each chunk count's transfers, and run(row) on the
    case's batches on its device (TeraPipe's run records appended to `runs`)."""
    from harness import make_batches

    batches = [{k: (v.to(case.device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
               for b in make_batches(case.num_microbatches, 1, case.model.seq_length,
                                     case.model.vocab_size, masked_rows=False)]
    models, configs = build_models(case, world_size)
    transfers = _transfers(case, configs)
    return models, transfers, _runner(case, models, batches, runs, transfers)


def _zero_grads(chunks: list) -> None:
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)


def virtual_speed_worker(rank: int, world_size: int, case: VirtualSpeedCase) -> dict:
    """Every row of `case`: one warm-up iteration (its losses kept, on the last stage), then
    `rounds` interleaved rounds, the order rotating every round; wall seconds per run, and for
    TeraPipe rows this stage's busy seconds (its cells' spans, "busy:" + label)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from harness import release_model_parallel, report_values
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode, pin_to_core

    if case.mps:
        from mps import enter_stage

        enter_stage(rank, world_size)  # this stage's SM share, before CUDA starts
    if case.device == "cpu":
        enable_cpu_mode()
        pin_to_core(rank, world_size)  # one core per stage, as one GPU per rank on GPUs
    runs: list = []  # TeraPipe's run records
    models, transfers, run = _rows_runner(case, world_size, runs)
    last_stage = parallel_state.is_pipeline_last_stage()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    # Host barriers over gloo: with NCCL for CUDA tensors a plain barrier could go to NCCL,
    # which refuses two ranks on one GPU.
    host = dist.new_group(backend="gloo")
    out: dict = {"last_stage": last_stage}
    for row in case.rows:
        out[row.label] = []
        staged = _staged(transfers[row.layout])
        losses = run(row)  # warm-up: allocator, connections, TeraPipe's schedule and buffers
        out["losses:" + row.label] = (report_values(losses)
                                      if row.holds_loss(pp_rank, world_size) else None)
        out["staged:" + row.label] = _staged(transfers[row.layout]) - staged  # messages moved
        _zero_grads(models[row.layout])
        if row.schedule == TERAPIPE:
            out["busy:" + row.label] = []
            out["received:" + row.label] = runs[-1].receives  # by the torch transport
    for round_ in range(case.rounds):
        # Rotate the order every round (as pipeline_runs.speed_worker does), so each row
        # follows each other one about equally often.
        shift = round_ % len(case.rows)
        for row in case.rows[shift:] + case.rows[:shift]:
            _zero_grads(models[row.layout])
            dist.barrier(group=host)
            start = time.perf_counter()
            run(row)
            if case.device == "cuda":
                torch.cuda.synchronize()
            dist.barrier(group=host)
            out[row.label].append(time.perf_counter() - start)
            if row.schedule == TERAPIPE:
                out["busy:" + row.label].append(sum(e.end - e.start for e in runs[-1].events))
    del models
    release_model_parallel()
    return out


def profile_in_run_worker(rank: int, world_size: int, model_cfg: TinyGPT, granularity: int,
                          layers_per_stage: int, paths: list, repeats: int,
                          warm_case: Optional[VirtualSpeedCase] = None) -> str:
    """Every stage's process measures the same layer profile at once, pinned to its core in
    CPU mode as the rows run, so each profile is measured with the other core busy, as the
    pipeline's cells are; the median of `repeats` runs (the rows' times are medians too).
    `warm_case`: first build its models and run its rows `rounds` times, so the profile is
    measured in the state the rows' processes run in (a layer can measure up to a third
    slower in the stage processes after pipeline iterations than fresh, near the pipeline's
    cells). Returns this rank's profile file."""
    from harness import release_model_parallel
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode, pin_to_core
    from pipeline_plans import profile_cost_model

    enable_cpu_mode()
    pin_to_core(rank, world_size)
    if os.path.exists(paths[rank]):
        os.remove(paths[rank])  # measured now, never an older run's
    models = None
    if warm_case is not None:
        models, _, run = _rows_runner(warm_case, world_size, [])
        for _ in range(warm_case.rounds):
            for row in warm_case.rows:
                run(row)
                _zero_grads(models[row.layout])
    profile_cost_model(model_cfg, granularity, layers_per_stage, "cpu", paths[rank],
                       statistic="median", repeats=repeats)
    if models is not None:
        del models
        release_model_parallel()
    return paths[rank]


def loss_difference(losses: list, reference: list) -> float:
    """Largest relative difference of the summed loss of any microbatch (report [sum, count])."""
    worst = 0.0
    for got, ref in zip(losses, reference):
        worst = max(worst, abs(got[0] - ref[0]) / max(abs(ref[0]), 1e-12))
    return worst

