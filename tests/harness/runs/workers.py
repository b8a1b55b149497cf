"""Multi-process worker bodies besides the equivalence cases: activation memory, changing
sequence lengths, refused batches, injected failures, the weight-gradient hooks, core pinning."""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from ..cases import Case, baseline
from ..compare import grad_pairs, load_full_state, report_values
from ..models import TinyGPT, build_stage_model, forward_step, make_batches
from ..process_groups import release_model_parallel


def run_megatron_1f1b(model, config, batches, seq_length: int, micro_batch_size: int,
                      forward_only: bool = False):
    """Megatron-Core's own non-interleaved 1F1B schedule (the baseline users run today)."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    return forward_backward_pipelining_without_interleaving(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=forward_only)


def measure_peak_activations(rank: int, world_size: int, model_cfg: TinyGPT, plans: dict,
                             num_microbatches: int, micro_batch_size: int,
                             include_megatron: bool = True) -> dict[str, int]:
    """Peak bytes of saved activations on this stage per schedule (a pipeline of world_size
    stages), each measured by the same SavedTensorMeter; "megatron_1f1b" is Megatron's 1F1B."""
    from megatron.core import parallel_state

    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe
    from megatron_terapipe.runtime.memory.saved_bytes import SavedTensorMeter

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    config, model = build_stage_model(model_cfg, 1, world_size)
    batches = make_batches(num_microbatches, micro_batch_size, model_cfg.seq_length,
                           model_cfg.vocab_size, seed=3)
    params = tuple(model.parameters())
    peaks: dict[str, int] = {}
    for name, plan in plans.items():
        with SavedTensorMeter(exclude=params) as meter:
            forward_backward_terapipe(
                forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                num_microbatches=num_microbatches, seq_length=model_cfg.seq_length,
                micro_batch_size=micro_batch_size, plan=plan)
        peaks[name] = meter.peak_bytes
        model.zero_grad(set_to_none=True)
    if include_megatron:
        with SavedTensorMeter(exclude=params) as meter:
            run_megatron_1f1b(model, config, batches, model_cfg.seq_length, micro_batch_size)
        peaks["megatron_1f1b"] = meter.peak_bytes
    release_model_parallel()
    return peaks


def run_variable_lengths(rank: int, world_size: int, lengths: list[int], plans: dict) -> list[dict]:
    """One TeraPipe model trained on batches whose length changes per iteration (PlanTable).

    Every iteration is compared with Megatron's no-pipelining baseline at that length: the
    gradient pairs and, on the last stage, both runs' reported losses.
    """
    from megatron.core import parallel_state

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.plan import PlanTable
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe

    enable_cpu_mode()
    base_case = Case("variable", None, model=TinyGPT(seq_length=max(lengths)), num_microbatches=2)
    data = {L: make_batches(2, 2, L, base_case.model.vocab_size, seed=L) for L in set(lengths)}
    refs = {L: baseline(base_case, data[L]) for L in set(lengths)}
    parallel_state.initialize_model_parallel(1, world_size)
    config, model = build_stage_model(base_case.model, 1, world_size)
    load_full_state(model, refs[lengths[0]][2])
    configure(config, PlanTable(plans))
    out = []
    for L in lengths:
        model.zero_grad(set_to_none=True)
        losses = forward_backward_terapipe(
            forward_step_func=forward_step, data_iterator=iter(data[L]), model=[model],
            num_microbatches=2, seq_length=L, micro_batch_size=2)
        result = {"length": L, "grads": grad_pairs(model, refs[L][1])}
        if parallel_state.is_pipeline_last_stage():
            result["losses"] = report_values(losses)
            result["ref_losses"] = report_values(refs[L][0])
        out.append(result)
    release_model_parallel()
    return out


def run_with_mismatched_batch(rank: int, world_size: int, seq_length: int, batch_length: int) -> None:
    """Call the schedule with seq_length that the data does not have (must raise, not hang)."""
    from megatron.core import parallel_state

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.plan import TeraPipePlan
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe

    enable_cpu_mode()
    model_cfg = TinyGPT(seq_length=max(seq_length, batch_length))
    parallel_state.initialize_model_parallel(1, world_size)
    config, model = build_stage_model(model_cfg, 1, world_size)
    configure(config, TeraPipePlan.uniform(seq_length, 2))
    batches = make_batches(2, 2, batch_length, model_cfg.vocab_size)
    forward_backward_terapipe(forward_step_func=forward_step, data_iterator=iter(batches),
                              model=[model], num_microbatches=2, seq_length=seq_length,
                              micro_batch_size=2)


class InjectedFailure(RuntimeError):
    pass


def _failing_step(rank: int, where: str):
    """forward_step that raises on its 3rd call (forward), or whose 2nd call's loss_func or
    backward raises."""
    calls = {"n": 0}

    def failing_loss(loss_mask, output_tensor):
        raise InjectedFailure(f"injected failure in loss_func on rank {rank}")

    def boom(grad):
        raise InjectedFailure(f"injected failure in backward on rank {rank}")

    def step(data_iterator, model):
        calls["n"] += 1
        if where == "forward" and calls["n"] == 3:
            raise InjectedFailure(f"injected failure in forward_step on rank {rank}")
        output, loss = forward_step(data_iterator, model)
        if where == "loss" and calls["n"] == 2:
            loss = partial(failing_loss, None)
        if where == "backward" and calls["n"] == 2:
            output.register_hook(boom)
        return output, loss
    return step


def run_with_failure(rank: int, world_size: int, fail_rank: int, where: str,
                     order: str = "1f1b") -> str:
    """A TeraPipe run in which `fail_rank` raises in forward_step, loss_func, backward or
    (where="wgrad", with deferred weight gradients) its first W action."""
    from megatron.core import parallel_state

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.plan import TeraPipePlan
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe

    enable_cpu_mode()
    model_cfg = TinyGPT(num_layers=world_size)
    parallel_state.initialize_model_parallel(1, world_size)
    config, model = build_stage_model(model_cfg, 1, world_size)
    configure(config, TeraPipePlan([4, 4, 8], order=order, defer_wgrad=where == "wgrad"))
    step = forward_step
    if rank == fail_rank and where == "wgrad":
        from megatron_terapipe.runtime.wgrad.store import WeightGradStore

        def failing_flush(self, sequence_key):
            raise InjectedFailure(f"injected failure in wgrad on rank {rank}")

        WeightGradStore.flush = failing_flush
    elif rank == fail_rank:
        step = _failing_step(rank, where)
    batches = make_batches(3, 2, model_cfg.seq_length, model_cfg.vocab_size)
    forward_backward_terapipe(forward_step_func=step, data_iterator=iter(batches), model=[model],
                              num_microbatches=3, seq_length=model_cfg.seq_length,
                              micro_batch_size=2)
    return "finished"


def grads_with_and_without_deferral_hooks(rank: int, world_size: int) -> float:
    """Megatron's own no-pipelining schedule on one model, before and after TeraPipe hooked its
    linear layers for deferred weight gradients: the largest gradient difference (must be 0:
    outside TeraPipe cells the layers run Megatron's code)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.megatron.model.param_deferral import install_wgrad_deferral

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, 1)
    model_cfg = TinyGPT()
    config, model = build_stage_model(model_cfg, 1, 1)
    batches = make_batches(2, 2, model_cfg.seq_length, model_cfg.vocab_size)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        forward_backward_no_pipelining(forward_step_func=forward_step, data_iterator=iter(batches),
                                       model=[model], num_microbatches=2,
                                       seq_length=model_cfg.seq_length, micro_batch_size=2)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    before = grads()
    hooked = install_wgrad_deferral(model)
    assert hooked > 0 and install_wgrad_deferral(model) == hooked  # idempotent
    after = grads()
    assert before.keys() == after.keys()
    release_model_parallel()
    return max(float((before[n] - after[n]).abs().max()) for n in before)


def pinned_core(rank: int, world_size: int) -> tuple[Optional[int], list[list[int]]]:
    """pin_to_core in a worker: the core it chose and every thread's affinity after."""
    import os

    from megatron_terapipe.megatron.platform.cpu_mode import pin_to_core, process_thread_ids

    core = pin_to_core(rank, world_size)
    return core, [sorted(os.sched_getaffinity(t)) for t in process_thread_ids()]


def environment_of(rank: int, world_size: int, names: list[str]) -> dict[str, Optional[str]]:
    """The worker's values of `names` (spawn's caller environment and rank additions)."""
    import os

    return {name: os.environ.get(name) for name in names}


def measured_choice_by_rank(rank: int, world_size: int) -> tuple[str, float]:
    """A MeasuredChoice whose clock disagrees between ranks (rank 1 sees TeraPipe at 20 ms,
    rank 0 at 5 ms; Megatron's schedule 12 ms on both), with the real cross-rank maximum."""
    from megatron_terapipe import MeasuredChoice, TeraPipePlan, TrialCandidate

    plan = TeraPipePlan([16, 16])
    seconds = {None: 0.012, plan: 0.005 if rank == 0 else 0.020}
    now = [0.0]

    def run(plan_or_none):
        now[0] += seconds[plan_or_none]

    choice = MeasuredChoice([TrialCandidate("Megatron 1F1B", None), TrialCandidate("TeraPipe", plan)],
                            trials=2, clock=lambda: now[0], log=lambda line: None)
    forward_backward = choice.wrap(lambda **kw: run(None), lambda plan, **kw: run(plan))
    for _ in range(7):
        forward_backward(forward_only=False)
    return choice.kept.name, round(choice.pick.medians["Megatron 1F1B"], 6)
