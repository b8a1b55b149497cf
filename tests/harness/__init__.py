"""Helpers for multi-process CPU runs: spawning gloo workers, small GPT models, baselines.

Used by the test suite, the examples and the benchmarks. Everything runs on CPU with gloo.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch


# --------------------------------------------------------------------------------------------
# Spawning workers
# --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _entry(rank: int, world_size: int, port: int, target: str, args: tuple, queue,
           threads: int, pg_timeout: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    import warnings

    warnings.filterwarnings("ignore")
    try:
        torch.distributed.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        result = _resolve(target)(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # report every failure, then exit so peers see the socket close
        queue.put((rank, False, traceback.format_exc()))
        queue.close()
        queue.join_thread()  # the report must reach the parent before this process dies
        sys.stderr.flush()
        os._exit(1)
    try:
        torch.distributed.destroy_process_group()
    except Exception:
        pass


class WorkerError(RuntimeError):
    """A worker failed. `reports` maps rank -> traceback for every rank that reported a failure;
    `killed` lists ranks the harness had to stop because they neither finished nor failed."""

    def __init__(self, message: str, reports: dict[int, str], killed: list[int]) -> None:
        super().__init__(message)
        self.reports = reports
        self.killed = killed


def spawn(world_size: int, target: str, *args: Any, timeout: float = 600.0, threads: int = 1,
          pg_timeout: float = 120.0, grace: float = 30.0) -> list[Any]:
    """Run `target(rank, world_size, *args)` ("module:function") on `world_size` gloo processes.

    Returns each rank's result. If any rank fails, the others get `grace` seconds to fail or
    finish on their own (a dead peer's closed socket ends their waits), then are killed;
    WorkerError carries every report. If the run exceeds `timeout` seconds, TimeoutError.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, target, args, queue, threads,
                                              pg_timeout), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    killed: list[int] = []
    try:
        while len(results) + len(failures) < world_size:
            now = time.monotonic()
            if now >= deadline:
                if failures:
                    break
                raise TimeoutError(f"{target} did not finish within {timeout:.0f} s on {world_size} ranks")
            try:
                rank, ok, payload = queue.get(timeout=min(deadline - now, 1.0))
            except Exception:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in failures and r not in results:
                        failures[r] = f"process exited with code {p.exitcode} without a report"
                continue
            if ok:
                results[rank] = payload
            else:
                failures[rank] = payload
                deadline = min(deadline, time.monotonic() + grace)
    finally:
        for r, p in enumerate(procs):
            p.join(timeout=2 if failures else 10)
            if p.is_alive():
                if r not in results and r not in failures:
                    killed.append(r)
                p.kill()
                p.join()
    if failures:
        first = min(failures)
        text = "\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(failures.items()))
        raise WorkerError(f"{len(failures)} of {world_size} ranks failed (first: rank {first})\n{text}",
                          failures, killed)
    return [results[r] for r in range(world_size)]


# --------------------------------------------------------------------------------------------
# Small GPT models on CPU
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TinyGPT:
    """A small GPT for CPU runs."""

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    vocab_size: int = 64
    seq_length: int = 16
    position_embedding_type: str = "rope"
    untie: bool = True
    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None
    recompute_modules: Optional[tuple[str, ...]] = None
    calculate_per_token_loss: bool = False
    seed: int = 1234

    def config(self, tp: int = 1, pp: int = 1):
        from megatron.core.transformer.transformer_config import TransformerConfig

        extra: dict[str, Any] = {}
        if self.recompute_granularity is not None:
            extra["recompute_granularity"] = self.recompute_granularity
            if self.recompute_granularity == "full":
                extra.update(recompute_method="uniform", recompute_num_layers=1)
            if self.recompute_modules is not None:
                extra["recompute_modules"] = list(self.recompute_modules)
        return TransformerConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, num_query_groups=self.num_query_groups,
            use_cpu_initialization=True, pipeline_dtype=self.params_dtype,
            params_dtype=self.params_dtype, bf16=self.bf16,
            hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            sequence_parallel=self.sequence_parallel and tp > 1,  # the TP=1 baseline has none
            calculate_per_token_loss=self.calculate_per_token_loss,
            **extra)

    def build(self, config, spec, pre_process: bool = True, post_process: bool = True):
        from megatron.core.models.gpt import GPTModel

        return GPTModel(config, spec, vocab_size=self.vocab_size,
                        max_sequence_length=self.seq_length, pre_process=pre_process,
                        post_process=post_process,
                        position_embedding_type=self.position_embedding_type,
                        share_embeddings_and_output_weights=not self.untie)


def make_batches(num: int, micro_batch_size: int, seq_length: int, vocab_size: int, seed: int = 0,
                 with_mask: bool = False, masked_rows: bool = True) -> list[dict[str, torch.Tensor]]:
    """Megatron-GPTDataset-style dicts of [b, s] tensors, with zeros in the loss masks."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=gen)
        loss_mask = (torch.rand(micro_batch_size, seq_length, generator=gen) > 0.25).float()
        if masked_rows:
            loss_mask[0, : seq_length // 2] = 0.0  # a fully masked stretch: empty cells happen
        batch = {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1).contiguous(),
        }
        if with_mask:
            batch["attention_mask"] = torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool).triu(1)
        else:
            batch["attention_mask"] = None
        batches.append(batch)
    return batches


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt-style loss: (summed masked loss, token count, report [sum, count])."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def legacy_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Older (loss, report) form: loss averaged over the unmasked tokens."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.clone().detach()}


def forward_step(data_iterator, model, legacy: bool = False):
    """An unmodified Megatron-style forward_step: read a batch, run the model, return loss_func."""
    from functools import partial

    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:
        output = model(None, None, None)
        return output, partial(legacy_loss_func if legacy else loss_func, None)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(legacy_loss_func if legacy else loss_func, batch["loss_mask"])


def legacy_forward_step(data_iterator, model):
    return forward_step(data_iterator, model, legacy=True)


# --------------------------------------------------------------------------------------------
# Weights and gradients between a full model and pipeline/tensor shards
# --------------------------------------------------------------------------------------------
def _global_name(model, name: str) -> str:
    """decoder.layers.<local>.x -> decoder.layers.<global>.x using each layer's layer_number."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        local = int(parts[2])
        parts[2] = str(model.decoder.layers[local].layer_number - 1)
    return ".".join(parts)


def _shard(full: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    from megatron.core import parallel_state

    if getattr(param, "tensor_model_parallel", False):
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        return full.chunk(tp, dim=param.partition_dim)[rank]
    return full


def unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _full_name(inner, name: str, full: dict) -> str:
    gname = _global_name(inner, name)
    if gname not in full and gname == "output_layer.weight":
        return "embedding.word_embeddings.weight"  # tied output layer on the last stage
    return gname


def load_full_state(model, full_state: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) model's weights into this rank's pipeline/tensor shard."""
    inner = unwrap(model)
    with torch.no_grad():
        for name, param in inner.named_parameters():
            full = full_state[_full_name(inner, name, full_state)]
            param.copy_(_shard(full, param).to(param.dtype))


def shard_grads(model) -> dict[str, torch.Tensor]:
    """This rank's gradients by global name (main_grad under Megatron DDP)."""
    inner = unwrap(model)
    out = {}
    for name, param in inner.named_parameters():
        g = getattr(param, "main_grad", None)
        if g is None:
            g = param.grad
        out[_global_name(inner, name)] = None if g is None else g.detach().clone()
    return out


def max_relative_error(grads: dict[str, Optional[torch.Tensor]], model,
                       full_grads: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Worst over parameters of max|g - g_ref| / max|g_ref| (reference sharded like g)."""
    inner = unwrap(model)
    params = dict(inner.named_parameters())
    worst, worst_name = 0.0, ""
    for name, param in params.items():
        gname = _global_name(inner, name)
        g = grads[gname]
        ref = _shard(full_grads[_full_name(inner, name, full_grads)], param).float()
        if g is None:
            err = float("inf") if ref.abs().max() > 0 else 0.0
        else:
            err = float((g.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        if err > worst:
            worst, worst_name = err, gname
    return worst, worst_name


# --------------------------------------------------------------------------------------------
# The equivalence experiment: Megatron's no-pipelining baseline vs. TeraPipe
# --------------------------------------------------------------------------------------------
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
    legacy_loss: bool = False
    slice_spec: bool = True  # False: build with Megatron's stock spec (TeraPipe must refuse)
    transport: Optional[str] = None  # "megatron": Megatron's P2PCommunicator, as on GPUs
    attn_mask_type: Optional[str] = None  # e.g. "no_mask": a non-causal spec (must be refused)
    bad_output: bool = False  # forward_step returns one token too few (must be refused)
    tolerance: float = 1e-5


def _seed(seed: int) -> None:
    from megatron_terapipe.megatron.cpu import cpu_model_parallel_seed

    cpu_model_parallel_seed(seed)


def _baseline(case: Case, batches: list[dict]) -> tuple[list[Any], dict[str, torch.Tensor], dict]:
    """Megatron's forward_backward_no_pipelining on the full model with Megatron's own spec."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    parallel_state.initialize_model_parallel(1, 1)
    _seed(case.model.seed)
    config = case.model.config()
    model = case.model.build(config, get_gpt_layer_local_spec())
    if case.model.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    state = {k: v.detach().clone().float() for k, v in unwrap(model).named_parameters()}
    fs = legacy_forward_step if case.legacy_loss else forward_step
    losses = forward_backward_no_pipelining(
        forward_step_func=fs, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=case.model.seq_length,
        micro_batch_size=case.micro_batch_size, forward_only=case.forward_only)
    grads = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for k, p in unwrap(model).named_parameters()}
    parallel_state.destroy_model_parallel()
    return losses, grads, state


def _report_values(losses: list[Any]) -> list[list[float]]:
    out = []
    for rep in losses:
        v = rep["lm loss"]
        out.append([float(x) for x in torch.as_tensor(v).float().view(-1)])
    return out


def run_case(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    """Worker body: baseline, then TeraPipe on the same weights and data; returns errors."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.cpu import enable_cpu_mode
    from megatron_terapipe.runtime.executor import forward_backward_terapipe
    from megatron_terapipe.megatron.spec import get_gpt_layer_spec

    enable_cpu_mode()
    dp = world_size // (case.tp * case.pp)
    batches_all = make_batches(case.num_microbatches * dp, case.micro_batch_size,
                               case.model.seq_length, case.model.vocab_size, seed=7,
                               with_mask=case.with_mask)
    ref_losses, ref_grads, full_state = _baseline(case, batches_all)

    parallel_state.initialize_model_parallel(case.tp, case.pp)
    _seed(case.model.seed + 1)  # different init: the weights must come from the copy below
    config = case.model.config(case.tp, case.pp)
    if case.slice_spec and case.model.sequence_parallel:
        from megatron_terapipe.megatron.spec import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config)
    elif case.slice_spec:
        spec = get_gpt_layer_spec()
        if case.attn_mask_type is not None:
            from megatron.core.transformer.enums import AttnMaskType

            spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType[case.attn_mask_type]
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec()
    model = case.model.build(config, spec,
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
    configure(config, case.plan)
    config.terapipe_transport = case.transport
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = batches_all[dp_rank * case.num_microbatches:(dp_rank + 1) * case.num_microbatches]
    fs = legacy_forward_step if case.legacy_loss else forward_step
    if case.bad_output:
        def fs(data_iterator, model, _inner=fs):
            output, loss = _inner(data_iterator, model)
            return (output[:-1] if not parallel_state.is_pipeline_last_stage() else output), loss
    losses = forward_backward_terapipe(
        forward_step_func=fs, data_iterator=iter(mine), model=[model],
        num_microbatches=case.num_microbatches, seq_length=case.model.seq_length,
        micro_batch_size=case.micro_batch_size, forward_only=case.forward_only)
    from megatron_terapipe.runtime.executor import LAST_RUN

    result: dict[str, Any] = {"rank": rank, "last_stage": parallel_state.is_pipeline_last_stage(),
                              "deferred_wgrads": LAST_RUN.deferred_wgrads,
                              "receives": LAST_RUN.receives,
                              "receives_posted_early": LAST_RUN.receives_posted_early}
    # What the torch transport must have received: an input per cell (but on the first stage),
    # and an output gradient per cell (but on the last stage, and when forward-only).
    cells = LAST_RUN.schedule.num_microbatches * LAST_RUN.schedule.plan.num_cells
    result["expected_receives"] = cells * (
        (not parallel_state.is_pipeline_first_stage())
        + (not parallel_state.is_pipeline_last_stage() and not case.forward_only))
    if parallel_state.is_pipeline_last_stage():
        mine_ref = ref_losses[dp_rank * case.num_microbatches:(dp_rank + 1) * case.num_microbatches]
        result["losses"] = _report_values(losses)
        result["ref_losses"] = _report_values(mine_ref)
    grads = shard_grads(model)
    if case.forward_only:
        result["any_grad"] = any(g is not None and bool(g.abs().sum() > 0) for g in grads.values())
    else:
        if dp > 1 and not case.ddp:
            raise ValueError("data parallel cases need ddp=True")
        # Megatron DDP averages over data-parallel ranks and each rank divides by its own
        # microbatch count, so the sum matches the baseline's 1 / (dp * microbatches).
        result["grad_error"], result["worst_param"] = max_relative_error(grads, model, ref_grads)
        result["num_params"] = len(grads)
    parallel_state.destroy_model_parallel()
    return result


def run_cases(rank: int, world_size: int, cases: list[Case]) -> dict[str, Any]:
    return {case.name: run_case(rank, world_size, case) for case in cases}


def check_case(results: list[dict[str, Any]], case: Case) -> None:
    """Assert one case of `run_cases` on every rank: gradients within the case's tolerance (or
    none, forward-only), every reported loss equal to the baseline's, weight gradients deferred
    when the plan says so, every receive of the torch transport posted before it was needed
    (but each stage's first input), and a last stage among the ranks."""
    import pytest

    saw_last = False
    for rank_result in results:
        r = rank_result[case.name]
        if case.transport != "megatron":
            assert r["receives"] == r["expected_receives"], r
            assert r["receives_posted_early"] >= r["receives"] - 1, (
                f"rank {r['rank']}: only {r['receives_posted_early']} of {r['receives']} "
                "receives were posted ahead")
        if case.forward_only:
            assert not r["any_grad"], f"rank {r['rank']}: forward_only left gradients"
        else:
            assert r["grad_error"] <= case.tolerance, (
                f"rank {r['rank']}: gradient of {r['worst_param']} off by {r['grad_error']:.2e}")
            assert r["num_params"] > 0
            if case.plan.defer_wgrad:  # the linear layers really left them to the W actions
                assert r["deferred_wgrads"] > 0, f"rank {r['rank']}: nothing was deferred"
        if r["last_stage"]:
            saw_last = True
            assert len(r["losses"]) == case.num_microbatches
            for got, ref in zip(r["losses"], r["ref_losses"]):
                assert got == pytest.approx(ref, rel=1e-3 if case.model.bf16 else 1e-5, abs=1e-6)
    assert saw_last


# --------------------------------------------------------------------------------------------
# Activation memory of a schedule
# --------------------------------------------------------------------------------------------
def build_stage_model(model_cfg: TinyGPT, tp: int, pp: int, spec=None):
    """This rank's pipeline stage of `model_cfg`, with the slice-aware spec by default."""
    from megatron.core import parallel_state

    from megatron_terapipe.megatron.spec import get_gpt_layer_spec

    config = model_cfg.config(tp, pp)
    _seed(model_cfg.seed)
    model = model_cfg.build(config, spec if spec is not None else get_gpt_layer_spec(),
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
    return config, model


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
    """Peak bytes of saved activations on this stage, per schedule (pipeline of world_size)."""
    from megatron.core import parallel_state

    from megatron_terapipe.megatron.cpu import enable_cpu_mode
    from megatron_terapipe.runtime.executor import forward_backward_terapipe
    from megatron_terapipe.runtime.memory import SavedTensorMeter

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
    parallel_state.destroy_model_parallel()
    return peaks


def run_variable_lengths(rank: int, world_size: int, lengths: list[int], plans: dict) -> list[dict]:
    """One TeraPipe model trained on batches whose length changes per iteration (PlanTable).

    Every iteration is compared with Megatron's no-pipelining baseline at that length.
    """
    from megatron.core import parallel_state

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.cpu import enable_cpu_mode
    from megatron_terapipe.runtime.executor import forward_backward_terapipe
    from megatron_terapipe.plan import PlanTable

    enable_cpu_mode()
    longest = max(lengths)
    base_case = Case("variable", None, model=TinyGPT(seq_length=longest), num_microbatches=2)
    data = {L: make_batches(2, 2, L, base_case.model.vocab_size, seed=L) for L in set(lengths)}
    refs = {L: _baseline(base_case, data[L]) for L in set(lengths)}
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
        err, name = max_relative_error(shard_grads(model), model, refs[L][1])
        result = {"length": L, "grad_error": err, "worst_param": name}
        if parallel_state.is_pipeline_last_stage():
            result["losses"] = _report_values(losses)
            result["ref_losses"] = _report_values(refs[L][0])
        out.append(result)
    parallel_state.destroy_model_parallel()
    return out


def run_with_mismatched_batch(rank: int, world_size: int, seq_length: int, batch_length: int) -> None:
    """Call the schedule with seq_length that the data does not have (must raise, not hang)."""
    from megatron.core import parallel_state

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.cpu import enable_cpu_mode
    from megatron_terapipe.runtime.executor import forward_backward_terapipe
    from megatron_terapipe.plan import TeraPipePlan

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


def run_with_failure(rank: int, world_size: int, fail_rank: int, where: str,
                     order: str = "1f1b") -> str:
    """A TeraPipe run in which `fail_rank` raises in forward_step, loss_func, backward or
    (where="wgrad", with deferred weight gradients) its first W action."""
    from functools import partial

    from megatron.core import parallel_state

    from megatron_terapipe import configure
    from megatron_terapipe.megatron.cpu import enable_cpu_mode
    from megatron_terapipe.runtime.executor import forward_backward_terapipe
    from megatron_terapipe.plan import TeraPipePlan

    enable_cpu_mode()
    model_cfg = TinyGPT(num_layers=world_size)
    parallel_state.initialize_model_parallel(1, world_size)
    config, model = build_stage_model(model_cfg, 1, world_size)
    configure(config, TeraPipePlan([4, 4, 8], order=order, defer_wgrad=where == "wgrad"))
    calls = {"n": 0}
    failing = rank == fail_rank
    if failing and where == "wgrad":
        from megatron_terapipe.runtime.wgrad import WeightGradStore

        def failing_flush(self, sequence_key):
            raise InjectedFailure(f"injected failure in wgrad on rank {rank}")

        WeightGradStore.flush = failing_flush

    def failing_loss(loss_mask, output_tensor):
        raise InjectedFailure(f"injected failure in loss_func on rank {rank}")

    def step(data_iterator, model):
        calls["n"] += 1
        if failing and where == "forward" and calls["n"] == 3:
            raise InjectedFailure(f"injected failure in forward_step on rank {rank}")
        output, loss = forward_step(data_iterator, model)
        if failing and where == "loss" and calls["n"] == 2:
            loss = partial(failing_loss, None)
        if failing and where == "backward" and calls["n"] == 2:
            def boom(grad):
                raise InjectedFailure(f"injected failure in backward on rank {rank}")
            output.register_hook(boom)
        return output, loss

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

    from megatron_terapipe.megatron.cpu import enable_cpu_mode
    from megatron_terapipe.runtime.wgrad import install_wgrad_deferral

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
    return max(float((before[n] - after[n]).abs().max()) for n in before)


def pinned_core(rank: int, world_size: int) -> tuple[Optional[int], list[list[int]]]:
    """pin_to_core in a worker: the core it chose and every thread's affinity after."""
    import os

    from megatron_terapipe.megatron.cpu import pin_to_core, process_thread_ids

    core = pin_to_core(rank, world_size)
    return core, [sorted(os.sched_getaffinity(t)) for t in process_thread_ids()]
