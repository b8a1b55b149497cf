"""Measured memory per stage, for comparing with the planner's prediction: each run's peak of
what the stage keeps for backward (autograd's saved tensors, K/V gradient buffers, deferred
weight-gradient pieces: runtime/memory/buffer_bytes.py), and a memory profile of the same model
measured as the planner's FittedMemory is (megatron/measure/memory.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..models import TinyGPT, build_stage_model, forward_step, make_batches
from ..process_groups import release_model_parallel


@dataclass(frozen=True)
class MemoryRun:
    """One schedule run: a TeraPipe plan, or None for Megatron's own 1F1B."""

    name: str
    plan: Optional[object]  # TeraPipePlan
    num_microbatches: int
    micro_batch_size: int


def measure_run_peaks(rank: int, world_size: int, model_cfg: TinyGPT,
                      runs: list[MemoryRun]) -> dict[str, int]:
    """This stage's peak bytes in each run (a pipeline of world_size stages, one model)."""
    import gc

    from megatron.core import parallel_state

    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe
    from megatron_terapipe.runtime.memory.buffer_bytes import RuntimeMemoryMeter

    from ..runs.workers import run_megatron_1f1b

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    config, model = build_stage_model(model_cfg, 1, world_size)
    params = tuple(model.parameters())
    peaks: dict[str, int] = {}
    for run in runs:
        batches = make_batches(run.num_microbatches, run.micro_batch_size, model_cfg.seq_length,
                               model_cfg.vocab_size, seed=3)
        gc.collect()
        with RuntimeMemoryMeter(exclude=params) as meter, meter.counting_runtime_buffers():
            if run.plan is None:
                run_megatron_1f1b(model, config, batches, model_cfg.seq_length,
                                  run.micro_batch_size)
            else:
                forward_backward_terapipe(
                    forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                    num_microbatches=run.num_microbatches, seq_length=model_cfg.seq_length,
                    micro_batch_size=run.micro_batch_size, plan=run.plan)
        peaks[run.name] = meter.peak_bytes
        model.zero_grad(set_to_none=True)
    release_model_parallel()
    return peaks


def measure_interleaved_peak(rank: int, world_size: int, model_cfg: TinyGPT, chunks: int,
                             num_microbatches: int) -> int:
    """This stage's peak bytes in one iteration of Megatron's interleaved 1F1B (`chunks`
    model chunks per stage, micro batch 1)."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving)

    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.runtime.memory.buffer_bytes import RuntimeMemoryMeter

    from .schedule_runs import interleaved_model

    enable_cpu_mode()
    _, model = interleaved_model(model_cfg, world_size, chunks)
    batches = make_batches(num_microbatches, 1, model_cfg.seq_length, model_cfg.vocab_size, seed=3)
    params = tuple(p for m in model for p in m.parameters())
    with RuntimeMemoryMeter(exclude=params) as meter:
        forward_backward_pipelining_with_interleaving(
            forward_step_func=forward_step, data_iterator=[iter(batches) for _ in model],
            model=model, num_microbatches=num_microbatches, seq_length=model_cfg.seq_length,
            micro_batch_size=1)
    release_model_parallel()
    return meter.peak_bytes


def measure_memory_profile(rank: int, world_size: int, model_cfg: TinyGPT, granularity: int = 8):
    """The FittedMemory of `model_cfg`'s layers (one process), as the planner would use it."""
    from megatron_terapipe.megatron.measure.memory import measure_memory
    from megatron_terapipe.planner.cost.dims import ModelDims
    from megatron_terapipe.planner.profile.memory_fit import FittedMemory

    dims = ModelDims(num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
                     num_attention_heads=model_cfg.num_attention_heads,
                     num_query_groups=model_cfg.num_query_groups, vocab_size=model_cfg.vocab_size)
    measured = measure_memory(dims, model_cfg.seq_length, granularity=granularity,
                              dtype="float32", device="cpu",
                              position_embedding_type=model_cfg.position_embedding_type)
    return FittedMemory.fit(measured).to_dict()


def measure_virtual_peaks(rank: int, world_size: int, model_cfg: TinyGPT, chunks: int,
                          runs: list[MemoryRun]) -> dict[str, int]:
    """This stage's peak bytes in each TeraPipe run on `chunks` model chunks per rank (the
    chunks as Megatron builds them for its interleaved schedule; every run's plan has
    virtual_stages = chunks)."""
    import gc

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe
    from megatron_terapipe.runtime.memory.buffer_bytes import RuntimeMemoryMeter

    from .schedule_runs import interleaved_model

    enable_cpu_mode()
    config, model = interleaved_model(model_cfg, world_size, chunks)
    params = tuple(p for m in model for p in m.parameters())
    peaks: dict[str, int] = {}
    for run in runs:
        batches = make_batches(run.num_microbatches, run.micro_batch_size, model_cfg.seq_length,
                               model_cfg.vocab_size, seed=3)
        configure(config, run.plan)
        gc.collect()
        with RuntimeMemoryMeter(exclude=params) as meter, meter.counting_runtime_buffers():
            forward_backward_terapipe(
                forward_step_func=forward_step, data_iterator=[iter(batches) for _ in model],
                model=model, num_microbatches=run.num_microbatches,
                seq_length=model_cfg.seq_length, micro_batch_size=run.micro_batch_size)
        peaks[run.name] = meter.peak_bytes
        for m in model:
            m.zero_grad(set_to_none=True)
    release_model_parallel()
    return peaks
