"""MoE router losses under TeraPipe against Megatron's no-pipelining run in the same layout.

Megatron's load-balancing losses and z-loss depend on the run's layout: the router reduces its
counts over the tensor-parallel ranks (global_aux_loss also over the data-parallel ones), and
each rank logs its own share. So the baseline here is Megatron's
`forward_backward_no_pipelining` on the full model with the case's TP, DP and EP (the process
groups are the TeraPipe run's; each pipeline rank runs the same full baseline and its pipeline
group stays unused), and TeraPipe then runs this rank's stage on the same weights and batches.
Compared per rank: every gradient (router weights included; under DDP the main_grad), every
reported loss, every MoE loss Megatron's tracker logged as Megatron-LM logs it (reduced by
`reduce_aux_losses_tracker_across_ranks`), and the routers' buffers (expert-bias counts and
bias, global_aux_loss's running sums).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import torch

from ..cases import batches_key, once_per_worker
from ..compare import FP32, Tolerance, check_gradients, check_losses, chunk_grads, global_name, report_values, unwrap
from ..models import TinyGPT, forward_step, loss_func, make_batches, seed
from ..process_groups import os_thread_count, release_model_parallel

#: Router buffers compared after the iteration (per layer, by global name).
ROUTER_BUFFERS = ("local_tokens_per_expert", "expert_bias", "global_tokens_per_expert", "ga_steps")


@dataclass(frozen=True)
class MoEGPT(TinyGPT):
    """TinyGPT with 4 experts and Megatron's router losses: `balancing` and `aux_coeffs` are
    moe_router_load_balancing_type and moe_aux_loss_coeff (lists when more than one)."""

    num_experts: Optional[int] = 4
    balancing: tuple[str, ...] = ("aux_loss",)
    aux_coeffs: tuple[float, ...] = (0.5,)
    z_loss_coeff: Optional[float] = None
    expert_bias: bool = False  # aux-loss-free balancing (Megatron needs sigmoid scores for it)

    def config(self, tp: int = 1, pp: int = 1, ep: int = 1):
        one = len(self.balancing) == 1
        return dataclasses.replace(
            super().config(tp, pp),
            moe_router_load_balancing_type=self.balancing[0] if one else list(self.balancing),
            moe_aux_loss_coeff=self.aux_coeffs[0] if one else list(self.aux_coeffs),
            moe_z_loss_coeff=self.z_loss_coeff, moe_router_enable_expert_bias=self.expert_bias,
            moe_router_score_function="sigmoid" if self.expert_bias else "softmax",
            expert_model_parallel_size=ep)


@dataclass(frozen=True)
class MoECase:
    """One TeraPipe run of an MoE model against Megatron's no-pipelining run, same layout."""

    name: str
    plan: Any  # TeraPipePlan
    model: MoEGPT = field(default_factory=MoEGPT)
    tp: int = 1
    pp: int = 2
    ep: int = 1
    num_microbatches: int = 3
    micro_batch_size: int = 2
    ddp: bool = False
    tolerance: Tolerance = FP32
    padding: bool = False  # forward_step passes a padding mask (the router skips those tokens)
    # Control: TeraPipe without its router-loss hooks (each cell's own Megatron losses); the
    # router gradients must then differ from the baseline's.
    per_cell_losses: bool = False


def padded_forward_step(data_iterator, model):
    """forward_step with the batch's padding mask for MoE routing (True: padding)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], padding_mask=batch["padding_mask"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def _forward_step(case: MoECase):
    return padded_forward_step if case.padding else forward_step


def _batches(case: MoECase, dp: int, dp_rank: int) -> list[dict]:
    n = case.num_microbatches
    batches = make_batches(n * dp, case.micro_batch_size, case.model.seq_length,
                           case.model.vocab_size, seed=7)[dp_rank * n:(dp_rank + 1) * n]
    if case.padding:  # the first row ends in padding, a different length per microbatch
        for i, batch in enumerate(batches):
            mask = torch.zeros_like(batch["tokens"], dtype=torch.bool)
            mask[0, case.model.seq_length - 3 - i:] = True
            batch["padding_mask"] = mask
    return batches


def _baseline_spec(case: MoECase, config):
    """Megatron's local layer spec; under sequence parallelism with norms that run it on CPU
    (Megatron's torch norm refuses it) and a block spec for the final norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(**case.model.spec_kwargs)
    if not config.sequence_parallel:
        return spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                              TransformerBlockSubmodules)

    from megatron_terapipe.megatron.model.layer_specs import TorchNorm, _local_norms_to_torch

    layer = _local_norms_to_torch(spec)
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * config.num_layers, layer_norm=TorchNorm))


def _terapipe_spec(case: MoECase, config, vp_stage: Optional[int] = None):
    from megatron_terapipe.megatron.model.layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_spec

    if config.sequence_parallel:
        return get_gpt_decoder_block_spec(config, vp_stage=vp_stage, **case.model.spec_kwargs)
    return get_gpt_layer_spec(**case.model.spec_kwargs)


def _wrap(case: MoECase, config, model):
    return _wrap_chunks(case, config, [model])[0]


def _wrap_chunks(case: MoECase, config, chunks: list) -> list:
    """Megatron DDP per model chunk, as Megatron-LM wraps them (bucketing on the first only)."""
    if not case.ddp:
        return chunks
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    chunks = [DistributedDataParallel(config, DistributedDataParallelConfig(), chunk,
                                      disable_bucketing=c > 0) for c, chunk in enumerate(chunks)]
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    for chunk in chunks:
        chunk.zero_grad_buffer()
    return chunks


def _buffers(*chunks) -> dict[str, torch.Tensor]:
    return {global_name(inner, name): buf.detach().clone() for inner in map(unwrap, chunks)
            for name, buf in inner.named_buffers() if name.rsplit(".", 1)[-1] in ROUTER_BUFFERS}


def _tracker_values() -> dict[str, torch.Tensor]:
    """Megatron's MoE loss tracker, name -> its per-layer values (the tracker's own tensors):
    0.19's `get_moe_metrics_tracker()`, 0.16's layer-wise dict."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # 0.16
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return {name: entry["values"] for name, entry in get_moe_layer_wise_logging_tracker().items()}
    return {name: entry.values for name, entry in get_moe_metrics_tracker().metrics.items()}


def _empty_tracker() -> None:
    """Forget every logged name, so that the next case logs from nothing."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # 0.16
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def _reduce_tracker(names: list[str], groups) -> None:
    """Megatron's reduction of the logged values, as its training log does it (0.19's tracker
    does it in report(), which also empties the values, so its _sync_metrics here)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # 0.16
        from megatron.core.transformer.moe.moe_utils import reduce_aux_losses_tracker_across_ranks

        reduce_aux_losses_tracker_across_ranks(names, pg_collection=groups)
    else:
        get_moe_metrics_tracker()._sync_metrics(names, groups)


def _logged(pp_group) -> dict[str, torch.Tensor]:
    """The MoE losses Megatron's tracker holds, reduced as Megatron-LM's training log reduces
    them (over the pipeline, the loss's group, data-parallel average), per layer."""
    from megatron.core import parallel_state

    names = sorted(_tracker_values())
    groups = SimpleNamespace(pp=pp_group, dp=parallel_state.get_data_parallel_group())
    _reduce_tracker(names, groups)
    values = _tracker_values()
    logged = {name: values[name].detach().clone() for name in names}
    for name in names:
        values[name].zero_()
    return logged


def _baseline(case: MoECase, batches: list[dict], solo_group) -> dict[str, Any]:
    """Megatron's run, once per worker for each model, layout and batch set (the plan and the
    control are TeraPipe's side)."""
    key = ("moe", case.model, case.tp, case.pp, case.ep, case.ddp, case.padding,
           case.num_microbatches, case.micro_batch_size, batches_key(batches))
    return once_per_worker(key, lambda: _run_baseline(case, batches, solo_group))


def _run_baseline(case: MoECase, batches: list[dict], solo_group) -> dict[str, Any]:
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    seed(case.model.seed)
    config = case.model.config(case.tp, 1, case.ep)  # the full model: every layer here
    model = case.model.build(config, _baseline_spec(case, config))
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    model = _wrap(case, config, model)
    losses = forward_backward_no_pipelining(
        forward_step_func=_forward_step(case), data_iterator=iter(batches), model=[model],
        num_microbatches=case.num_microbatches, seq_length=case.model.seq_length,
        micro_batch_size=case.micro_batch_size)
    result = {"losses": report_values(losses), "grads": chunk_grads([model], zeros_if_absent=True),
              "state": state, "buffers": _buffers(model), "logged": _logged(solo_group)}
    del model, config
    return result


def _terapipe(case: MoECase, batches: list[dict], state: dict) -> dict[str, Any]:
    from megatron.core import parallel_state

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.model import moe_router_losses
    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe

    seed(case.model.seed + 1)  # different init: the weights must come from the copy below
    config = case.model.config(case.tp, case.pp, case.ep)
    V = case.plan.virtual_stages
    if V > 1:  # V model chunks per rank, as Megatron builds them for its interleaved 1F1B
        config.virtual_pipeline_model_parallel_size = V
        config.microbatch_group_size_per_vp_stage = case.pp
    chunks = _wrap_chunks(case, config, [_stage_chunk(case, config, state, c if V > 1 else None)
                                         for c in range(V)])
    configure(config, case.plan)
    if case.per_cell_losses:
        original, moe_router_losses.install_moe_losses = moe_router_losses.install_moe_losses, lambda m: 0
    try:
        losses = forward_backward_terapipe(
            forward_step_func=_forward_step(case), model=chunks,
            data_iterator=[iter(batches) for _ in chunks] if V > 1 else iter(batches),
            num_microbatches=case.num_microbatches, seq_length=case.model.seq_length,
            micro_batch_size=case.micro_batch_size)
    finally:
        if case.per_cell_losses:
            moe_router_losses.install_moe_losses = original
    result = {"losses": report_values(losses), "grads": chunk_grads(chunks, zeros_if_absent=True),
              "buffers": _buffers(*chunks),
              "logged": _logged(parallel_state.get_pipeline_model_parallel_group())}
    del chunks, config
    return result


def _stage_chunk(case: MoECase, config, state: dict, vp_stage: Optional[int]):
    """This rank's stage (or its model chunk `vp_stage`) with the baseline's weights."""
    from megatron.core import parallel_state

    edges = dict(ignore_virtual=False, vp_stage=vp_stage) if vp_stage is not None else {}
    model = case.model.build(config, _terapipe_spec(case, config, vp_stage),
                             pre_process=parallel_state.is_pipeline_first_stage(**edges),
                             post_process=parallel_state.is_pipeline_last_stage(**edges),
                             vp_stage=vp_stage)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[global_name(model, name)])
    return model


def run_moe_case(rank: int, case: MoECase, solo_group) -> dict[str, Any]:
    """Megatron's no-pipelining run, then TeraPipe's, in the layout initialised for the case;
    `solo_group`: a group of this rank alone (the baseline's pipeline)."""
    from megatron.core import parallel_state

    batches = _batches(case, parallel_state.get_data_parallel_world_size(),
                       parallel_state.get_data_parallel_rank())
    ref = _baseline(case, batches, solo_group)
    ours = _terapipe(case, batches, ref["state"])
    last = parallel_state.is_pipeline_last_stage()
    _empty_tracker()  # the next case logs from zero
    return {"rank": rank, "last_stage": last,
            "grads": {name: (g, ref["grads"][name]) for name, g in ours["grads"].items()},
            "buffers": {name: (b, ref["buffers"][name]) for name, b in ours["buffers"].items()},
            "logged": {name: (v, ref["logged"].get(name)) for name, v in ours["logged"].items()},
            "losses": ours["losses"] if last else None, "ref_losses": ref["losses"]}


#: run_moe_cases' entry for the worker's OS threads after each layout's release.
THREADS_AFTER_RELEASE = "threads after each release"


def run_moe_cases(rank: int, world_size: int, cases: list[MoECase]) -> dict[str, Any]:
    """Worker body: every case, with Megatron's process groups initialised once per run of
    consecutive cases with the same TP / PP / EP / virtual stages (a gloo group costs a
    rendezvous to make and a collection to release)."""
    import itertools

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    results: dict[str, Any] = {THREADS_AFTER_RELEASE: []}

    def layout(case: MoECase) -> tuple[int, int, int, Optional[int]]:
        V = case.plan.virtual_stages
        return case.tp, case.pp, case.ep, V if V > 1 else None

    for (tp, pp, ep, V), same_layout in itertools.groupby(cases, layout):
        parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=V,
                                                 expert_model_parallel_size=ep)
        solo_group, _ = dist.new_subgroups(group_size=1)
        for case in same_layout:
            results[case.name] = run_moe_case(rank, case, solo_group)
        del solo_group
        release_model_parallel()
        results[THREADS_AFTER_RELEASE].append(os_thread_count())
    return results


def expected_logs(model: MoEGPT) -> set[str]:
    """The tracker names Megatron logs for `model`'s losses."""
    from megatron_terapipe.megatron.model.moe_loss_sums import SWITCH_LOSS_NAMES

    names = {SWITCH_LOSS_NAMES[kind] for kind, coeff in zip(model.balancing, model.aux_coeffs)
             if coeff > 0 and kind in SWITCH_LOSS_NAMES}
    return names | ({"z_loss"} if model.z_loss_coeff is not None else set())


def check_moe_case(results: list[dict[str, Any]], case: MoECase) -> None:
    """Assert one case on every rank: gradients, reported losses, logged MoE losses (each one
    the model has, non-zero, and nothing else) and router buffers equal the baseline's."""
    tol = case.tolerance
    for rank_result in results:
        r = rank_result[case.name]
        where = f"{case.name}, rank {r['rank']}"
        check_gradients(r["grads"], tol, where)
        if r["last_stage"]:
            check_losses(r["losses"], r["ref_losses"], tol, where)
        assert set(r["logged"]) == expected_logs(case.model), (where, sorted(r["logged"]))
        for name, (ours, ref) in r["logged"].items():
            assert ref is not None and ref.abs().min() > 0, f"{where}: {name} not logged per layer"
            torch.testing.assert_close(ours, ref, rtol=tol.loss_rtol, atol=tol.loss_atol,
                                       msg=lambda m, name=name: f"{where}: logged {name}: {m}")
        for name, (ours, ref) in r["buffers"].items():
            torch.testing.assert_close(ours, ref, rtol=0, atol=0,
                                       msg=lambda m, name=name: f"{where}: buffer {name}: {m}")
