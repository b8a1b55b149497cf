"""Timed iterations of every candidate schedule on one CPU pipeline, for checking the
planner's choice of schedule against measurements: Megatron's 1F1B and TeraPipe plans on one
stage model per rank, Megatron's interleaved 1F1B on model chunks (virtual pipeline stages)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..models import TinyGPT, build_stage_model, forward_step, make_batches
from ..process_groups import release_model_parallel


@dataclass
class ScheduleRuns:
    """What to time: label -> TeraPipe plan, None for Megatron's 1F1B, or the number of model
    chunks (an int, 2 or more) for Megatron's interleaved 1F1B."""

    model: TinyGPT
    num_microbatches: int
    repeats: int
    schedules: dict = field(default_factory=dict)


def interleaved_model(model_cfg: TinyGPT, stages: int, chunks: int, initialize: bool = True):
    """This rank's model chunks for Megatron's interleaved schedule (virtual stage c * K + k);
    `initialize`: set up Megatron's process groups for them first."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_terapipe.megatron.model.layer_specs import get_gpt_layer_spec

    from ..models import seed

    if initialize:
        parallel_state.initialize_model_parallel(1, stages,
                                                 virtual_pipeline_model_parallel_size=chunks)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(chunks)
    config = model_cfg.config(1, stages)
    config.virtual_pipeline_model_parallel_size = chunks
    config.microbatch_group_size_per_vp_stage = stages
    seed(model_cfg.seed)
    out = []
    for c in range(chunks):
        out.append(GPTModel(
            config, get_gpt_layer_spec(), vocab_size=model_cfg.vocab_size,
            max_sequence_length=model_cfg.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=c),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=c),
            position_embedding_type=model_cfg.position_embedding_type,
            share_embeddings_and_output_weights=not model_cfg.untie, vp_stage=c))
    return config, out


def _runner(label, schedule, model, config, runs: ScheduleRuns, batches):
    """A function running one iteration of `schedule` on `model` (one module or chunks)."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving,
        forward_backward_pipelining_without_interleaving)

    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe

    common = dict(forward_step_func=forward_step, num_microbatches=runs.num_microbatches,
                  seq_length=runs.model.seq_length, micro_batch_size=1)
    if isinstance(schedule, int):
        return lambda: forward_backward_pipelining_with_interleaving(
            data_iterator=[iter(batches) for _ in model], model=model, **common)
    if schedule is None:
        return lambda: forward_backward_pipelining_without_interleaving(
            data_iterator=iter(batches), model=[model], **common)
    return lambda: forward_backward_terapipe(data_iterator=iter(batches), model=[model],
                                             plan=schedule, **common)


def time_schedules(rank: int, world_size: int, runs: ScheduleRuns) -> dict[str, list[float]]:
    """Seconds per iteration of each schedule, `repeats` rounds, the order rotating each round
    over every schedule, the interleaved ones (on their own model chunks) included, so that
    machine noise hits every schedule alike."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode, pin_to_core

    enable_cpu_mode()
    pin_to_core(rank, world_size)
    batches = make_batches(runs.num_microbatches, 1, runs.model.seq_length,
                           runs.model.vocab_size, masked_rows=False)
    chunk_counts = sorted({v for v in runs.schedules.values() if isinstance(v, int)})
    # One set of process groups for every model (pipeline groups do not depend on chunks).
    parallel_state.initialize_model_parallel(
        1, world_size, virtual_pipeline_model_parallel_size=chunk_counts[0] if chunk_counts else None)
    config, model = build_stage_model(runs.model, 1, world_size)
    chunked = {v: interleaved_model(runs.model, world_size, v, initialize=False) for v in chunk_counts}
    runners, modules = {}, [model]
    for label, schedule in runs.schedules.items():
        chunks = schedule if isinstance(schedule, int) else None
        config_, model_ = chunked[chunks] if chunks else (config, model)
        runners[label] = _with_virtual_size(
            chunks, _runner(label, schedule, model_, config_, runs, batches))
    for _, chunk_models in chunked.values():
        modules += chunk_models
    times = _rounds(runners, modules, runs.repeats, dist)
    release_model_parallel()
    return times


def _with_virtual_size(chunks, run):
    """`run` with Megatron's virtual pipeline size set as its schedule expects (None: none)."""
    from megatron.core import parallel_state

    def wrapped():
        parallel_state.set_virtual_pipeline_model_parallel_world_size(chunks)
        parallel_state.set_virtual_pipeline_model_parallel_rank(0 if chunks else None)
        return run()
    return wrapped


def _rounds(runners: dict, modules: list, repeats: int, dist) -> dict[str, list[float]]:
    labels = list(runners)
    for label in labels:  # warm-up: allocator, gloo connections
        runners[label]()
    times: dict[str, list[float]] = {label: [] for label in labels}
    for round_ in range(repeats):
        shift = round_ % len(labels)
        for label in labels[shift:] + labels[:shift]:
            for m in modules:
                m.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            runners[label]()
            dist.barrier()
            times[label].append(time.perf_counter() - start)
    return times


def stage_seconds(times: list[dict[str, list[float]]], label: str) -> list[float]:
    """Per round, the slowest rank's seconds."""
    return [max(t[label][i] for t in times) for i in range(len(times[0][label]))]

