"""The equivalence experiment: Megatron's no-pipelining run on the full model against a TeraPipe
run on the same weights and batches, compared gradient by gradient and loss by loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .compare import (FP32, Tolerance, check_gradients, check_losses, grad_pairs, load_full_state,
                      report_values, unwrap)
from .models import TinyGPT, forward_step, legacy_forward_step, make_batches, seed
from .process_groups import release_model_parallel


@dataclass(frozen=True)
class Case:
    """One TeraPipe run compared with Megatron's no-pipelining run on one rank."""

    name: str
    plan: Any  # TeraPipePlan
    tp: int = 1
    pp: int = 2
    num_microbatches: int = 3
    micro_batch_size: int = 2
    model: TinyGPT = field(default_factory=TinyGPT)
    ddp: bool = False
    overlap_grad_reduce: bool = False  # DDP launches bucket all-reduces from gradient hooks
    forward_only: bool = False
    with_mask: bool = False
    packed: bool = False  # documents packed in each row: block-diagonal masks, reset positions
    legacy_loss: bool = False
    slice_spec: bool = True  # False: build with Megatron's stock spec (TeraPipe must refuse)
    transport: Optional[str] = None  # "megatron": Megatron's P2PCommunicator, as on GPUs
    attn_mask_type: Optional[str] = None  # e.g. "no_mask": a non-causal spec (must be refused)
    bad_output: bool = False  # forward_step returns one token too few (must be refused)
    deallocate_outputs: bool = False  # config.deallocate_pipeline_outputs: free sent outputs
    scatter_gather: bool = False  # config.terapipe.scatter_gather: messages in TP parts
    tolerance: Tolerance = FP32


#: A worker's baseline results, by what each depends on (cases that differ only on
#: TeraPipe's side share one). Read only by the callers.
_BASELINES: dict[tuple, Any] = {}


def once_per_worker(key: tuple, compute: Callable[[], Any]) -> Any:
    """`compute()`'s result, computed once per worker process for `key`."""
    if key not in _BASELINES:
        _BASELINES[key] = compute()
    return _BASELINES[key]


def baseline(case: Case, batches: list[dict]) -> tuple[list[Any], dict[str, torch.Tensor], dict]:
    """Megatron's forward_backward_no_pipelining on the full model with Megatron's own spec:
    (reported losses, gradients by name, the float32 weights it started from). Computed once
    per worker for each model, batch set and loss function (order, plan, transport, deferral
    and the TP/PP/DDP layout are TeraPipe's side)."""
    key = ("dense", case.model, case.micro_batch_size, case.legacy_loss, case.forward_only,
           batches_key(batches))
    return once_per_worker(key, lambda: _run_baseline(case, batches))


def batches_key(batches: list[dict]) -> tuple:
    """The batches' values themselves (small: equal keys, equal batches)."""
    def value(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), str(v.dtype), v.cpu().numpy().tobytes()
        return repr(v)

    return tuple(tuple((k, value(v)) for k, v in sorted(b.items())) for b in batches)


def _run_baseline(case: Case, batches: list[dict]) -> tuple[list[Any], dict[str, torch.Tensor], dict]:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    parallel_state.initialize_model_parallel(1, 1)
    seed(case.model.seed)
    config = case.model.config()
    model = case.model.build(config, get_gpt_layer_local_spec(**case.model.spec_kwargs))
    if case.model.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    state = {k: v.detach().clone().float() for k, v in unwrap(model).named_parameters()}
    losses = forward_backward_no_pipelining(
        forward_step_func=legacy_forward_step if case.legacy_loss else forward_step,
        data_iterator=iter(batches), model=[model], num_microbatches=len(batches),
        seq_length=case.model.seq_length, micro_batch_size=case.micro_batch_size,
        forward_only=case.forward_only)
    grads = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for k, p in unwrap(model).named_parameters()}
    del model, config  # the model holds its groups: their threads end when it goes
    release_model_parallel()
    return losses, grads, state


def _terapipe_spec(case: Case, config):
    """The slice-aware spec (or, for the refusal cases, Megatron's stock or a non-causal one)."""
    from megatron_terapipe.megatron.model.layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_spec

    if not case.slice_spec:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec()
    if case.model.sequence_parallel:
        return get_gpt_decoder_block_spec(config)
    spec = get_gpt_layer_spec(**case.model.spec_kwargs)
    if case.attn_mask_type is not None:
        from megatron.core.transformer.enums import AttnMaskType

        spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType[case.attn_mask_type]
    return spec


def _terapipe_model(case: Case, full_state: dict):
    """This rank's stage with the baseline's weights, wrapped as the case says."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    parallel_state.initialize_model_parallel(case.tp, case.pp)
    seed(case.model.seed + 1)  # different init: the weights must come from the copy below
    config = case.model.config(case.tp, case.pp)
    model = case.model.build(config, _terapipe_spec(case, config),
                             pre_process=parallel_state.is_pipeline_first_stage(),
                             post_process=parallel_state.is_pipeline_last_stage())
    load_full_state(model, full_state)
    if case.model.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if case.ddp:
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=case.overlap_grad_reduce,
                                                   use_distributed_optimizer=False)
        model = DistributedDataParallel(config, ddp_config, model)
        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        model.zero_grad_buffer()
    return config, model


def _forward_step(case: Case):
    from megatron.core import parallel_state

    fs = legacy_forward_step if case.legacy_loss else forward_step
    if not case.bad_output:
        return fs

    def short_output(data_iterator, model):
        output, loss = fs(data_iterator, model)
        return (output[:-1] if not parallel_state.is_pipeline_last_stage() else output), loss
    return short_output


def _run_record(case: Case, record) -> dict[str, Any]:
    """What the executor recorded of the run (its RunRecord): deferred weight gradients,
    receives and freed outputs."""
    from megatron.core import parallel_state

    result: dict[str, Any] = {"deferred_wgrads": record.deferred_wgrads,
                              "receives": record.receives,
                              "receives_posted_early": record.receives_posted_early,
                              "received_elements": record.received_elements,
                              "outputs_deallocated": record.outputs_deallocated}
    # What the torch transport must have received: an input per cell (but on the first stage),
    # and an output gradient per cell (but on the last stage, and when forward-only).
    schedule = record.schedule  # a plan's edge_slices cut some microbatches differently
    cells = sum(schedule.plan.cells_of(m, schedule.num_microbatches)
                for m in range(schedule.num_microbatches))
    result["cells"] = cells
    result["expected_receives"] = cells * (
        (not parallel_state.is_pipeline_first_stage())
        + (not parallel_state.is_pipeline_last_stage() and not case.forward_only))
    return result


def run_case(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    """Worker body: the baseline, then TeraPipe on the same weights and data. Returns the
    losses both reported (last stage) and every gradient pair (see compare.grad_pairs)."""
    from megatron.core import parallel_state

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe

    enable_cpu_mode()
    dp = world_size // (case.tp * case.pp)
    if dp > 1 and not case.ddp:
        raise ValueError("data parallel cases need ddp=True")
    batches = make_batches(case.num_microbatches * dp, case.micro_batch_size,
                           case.model.seq_length, case.model.vocab_size, seed=7,
                           with_mask=case.with_mask, packed=case.packed)
    ref_losses, ref_grads, full_state = baseline(case, batches)
    config, model = _terapipe_model(case, full_state)
    configure(config, case.plan)
    config.terapipe.transport = case.transport  # configure made config.terapipe
    config.terapipe.scatter_gather = case.scatter_gather
    config.deallocate_pipeline_outputs = case.deallocate_outputs
    records: list = []
    # Megatron DDP averages over data-parallel ranks and each rank divides by its own
    # microbatch count, so the sum matches the baseline's 1 / (dp * microbatches).
    mine = slice(parallel_state.get_data_parallel_rank() * case.num_microbatches,
                 (parallel_state.get_data_parallel_rank() + 1) * case.num_microbatches)
    losses = forward_backward_terapipe(
        forward_step_func=_forward_step(case), data_iterator=iter(batches[mine]), model=[model],
        num_microbatches=case.num_microbatches, seq_length=case.model.seq_length,
        micro_batch_size=case.micro_batch_size, forward_only=case.forward_only,
        on_run=records.append)
    result = {"rank": rank, "last_stage": parallel_state.is_pipeline_last_stage(),
              **_run_record(case, records[-1])}
    if result["last_stage"]:
        result["losses"] = report_values(losses)
        result["ref_losses"] = report_values(ref_losses[mine])
    result["grads"] = grad_pairs(model, ref_grads)
    del model, config  # the model holds its groups: their threads end when it goes
    release_model_parallel()
    return result


def run_cases(rank: int, world_size: int, cases: list[Case]) -> dict[str, Any]:
    return {case.name: run_case(rank, world_size, case) for case in cases}


def _per_token_loss_tokens(results: list[dict[str, Any]], case: Case) -> Optional[float]:
    """With calculate_per_token_loss the gradients are of the masked token sum, not the mean:
    the loss tokens of all microbatches (from the baseline's [sum, count] reports), by which
    both sides are divided so that the tolerance's atol is in the same units as every other
    case's. None for the other cases."""
    if not case.model.calculate_per_token_loss or case.forward_only:
        return None
    reports = [r[case.name]["ref_losses"] for r in results if r[case.name]["last_stage"]]
    return float(sum(report[1] for report in reports[0]))


def check_case(results: list[dict[str, Any]], case: Case) -> None:
    """Assert one case of `run_cases` on every rank: every gradient within the case's tolerance
    (or none at all, forward-only), every reported loss equal to the baseline's, weight
    gradients deferred when the plan says so, every receive of the torch transport posted
    before it was needed (but each stage's first input), and a last stage among the ranks."""
    saw_last = False
    tokens = _per_token_loss_tokens(results, case)
    for rank_result in results:
        r = rank_result[case.name]
        where = f"{case.name}, rank {r['rank']}"
        if case.transport != "megatron":
            assert r["receives"] == r["expected_receives"], r
            assert r["receives_posted_early"] >= r["receives"] - 1, (
                f"{where}: only {r['receives_posted_early']} of {r['receives']} receives were "
                "posted ahead")
        if case.forward_only:
            assert all(g is None or not g.any() for g, _ in r["grads"].values()), (
                f"{where}: forward_only left gradients")
        else:
            grads = r["grads"] if tokens is None else {
                n: (None if g is None else g / tokens, ref / tokens)
                for n, (g, ref) in r["grads"].items()}
            check_gradients(grads, case.tolerance, where)
            if case.plan.defer_wgrad:  # the linear layers really left them to the W actions
                assert r["deferred_wgrads"] > 0, f"{where}: nothing was deferred"
        if case.deallocate_outputs and not r["last_stage"]:  # every sent output was freed
            assert r["outputs_deallocated"] == r["cells"], f"{where}: {r['outputs_deallocated']}"
        if r["last_stage"]:
            saw_last = True
            check_losses(r["losses"], r["ref_losses"], case.tolerance, where)
            assert len(r["losses"]) == case.num_microbatches
    assert saw_last, f"{case.name}: no rank was the last stage"
