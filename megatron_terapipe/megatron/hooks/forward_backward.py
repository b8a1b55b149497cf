"""The TeraPipe schedule entry point, with the signature of Megatron's built-in schedules.

`forward_backward_terapipe` builds the per-stage action lists (schedule/) for the configured
plan, checks that the plan fits the run and the model, and runs this stage's list with the
torch-only executor (runtime/executor.py). Here sits what that executor must not know about:
Megatron's process groups, model config, wrapped models, per-microbatch hooks and gradient
finalisation.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, List, Optional, Union

import torch

from ...plan import TeraPipePlan
from ...runtime.attention.slice_attention import SliceAttention
from ...runtime.batching import CellData
from ...runtime.memory.buffer_pool import BufferPool
from ...runtime.executor import StageExecutor, StageModel, StageOptions
from ...runtime.graphs.cell_graphs import CellGraphs, cuda_graph_factory
from ...runtime.trace import RunRecord
from ...schedule import Cell, Lowering, LoweredSchedule, build_lowered_schedule
from ..platform import compat
from ..model import moe_router_losses
from ..model.param_deferral import install_wgrad_deferral
from .p2p import check_shared_link, make_transport
from ..model.rope import install_rope_offsets
from ..support.refusals import check_view
from .selection import check_replaced_attributes, config_view, run_config
from ..model.v_chunks import check_v_chunks

RunCallback = Callable[[RunRecord], None]


def forward_backward_terapipe(
    *,
    forward_step_func: Callable,
    data_iterator: Union[Iterator, List[Iterator], None],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: Optional[bool] = False,
    plan: Optional[TeraPipePlan] = None,
    on_run: Optional[RunCallback] = None,
) -> list[Any]:
    """Run forward and backward of `num_microbatches` microbatches with token-slice pipelining.

    Same keywords and return value as Megatron's built-in schedules: the list of what loss_func
    reported per microbatch on the last stage, [] elsewhere. The plan: `plan=`, else
    config.terapipe's (`configure`), else the flags' (`select`). The stage's RunRecord goes to
    `config.terapipe.on_run` and `on_run`.
    """
    from megatron.core.utils import get_model_config

    models, iterators = _model_chunks(model, data_iterator)
    config = get_model_config(models[0])
    terapipe, groups = run_config(config), _process_groups(pg_collection)
    plan = plan or resolve_plan(terapipe.plan, seq_length, micro_batch_size)
    check_run(config, models, plan, groups, seq_length, micro_batch_size, num_microbatches,
              decoder_seq_length, adjust_tensor_shapes_fn)
    for chunk in models:
        prepare_model(chunk)
    tp_size = groups.tp.size() if groups.tp is not None else 1
    pp, device = groups.pp, _device_of(models[0])
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    transport, memory = _transport_and_memory(models, config, device, plan, num_microbatches,
                                              groups, micro_batch_size, forward_only,
                                              p2p_communicator)
    executor = StageExecutor(
        memory.schedule, pp.rank() if pp is not None else 0,
        [_stage_model(chunk, forward_step_func, first_val_step, forward_only) for chunk in models],
        [CellData(it, seq_length, micro_batch_size) for it in iterators], transport,
        _stage_options(config, tp_size, forward_only, collect_non_loss_data), device,
        pool=memory.pool, graphs=memory.graphs)
    result = executor.run()
    for callback in filter(None, (terapipe.on_run, on_run)):
        callback(executor.record)
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(models, _token_count(config, executor, plan, pp),
                                         pg_collection=groups, force_all_reduce=force_all_reduce)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return result


def _token_count(config, executor: StageExecutor, plan: TeraPipePlan, pp):
    """The loss's token count for finalize_model_grads (per-token loss; else None), which
    broadcasts it from the last rank: in a V the loss is on rank 0, so it is there first."""
    if not config.calculate_per_token_loss:
        return None
    num_tokens = executor.loss.total_num_tokens
    if plan.virtual_placement == "v" and pp is not None:
        torch.distributed.broadcast(num_tokens, group=pp,
                                    src=torch.distributed.get_process_group_ranks(pp)[0])
    return num_tokens


def _transport_and_memory(models: list, config, device: torch.device, plan: TeraPipePlan,
                          num_microbatches: int, groups, micro_batch_size: int,
                          forward_only: bool, p2p_communicator):
    """The stage's transport (a ring with virtual stages; sends that do not wait for an
    edge-sliced plan) and the plan's schedule and buffers, with each chunk's MoE loss counters
    started for the iteration."""
    pp = groups.pp
    transport = make_transport(pp, config, device, p2p_communicator, ring=len(models) > 1,
                               tp_group=groups.tp, sends_wait=not plan.edge_slices)
    memory = plan_memory(models[0], config, device, plan, num_microbatches,
                         pp.size() if pp is not None else 1, micro_batch_size, forward_only,
                         transport.lowering)
    carrier = getattr(transport, "inner", transport)  # under a ScatterGatherTransport
    if getattr(carrier, "ring", False):  # Megatron's communicator on virtual stages
        check_shared_link(memory.schedule)
    for chunk in models:
        moe_router_losses.begin_iteration(chunk, config, memory.schedule.schedule, device)
    return transport, memory


#: Pools kept per model (the most recently used plans and batch shapes; a PlanTable run with
#: many sequence lengths would otherwise hold every length's K/V buffers).
POOLS_PER_MODEL = 4


@dataclass
class PlanMemory:
    """What a stage keeps across iterations for one plan and batch shape: the schedule,
    validated and lowered for the stage's transport (schedule/build.py: built once, not per
    iteration), the pool that puts cells' buffers at fixed addresses, and the CUDA graphs
    captured on those addresses (they go together: graphs of a dropped pool would read freed
    memory)."""

    schedule: LoweredSchedule
    pool: BufferPool
    graphs: Optional[CellGraphs] = None


def plan_memory(model: torch.nn.Module, config, device: torch.device, plan: TeraPipePlan,
                num_microbatches: int, num_stages: int, micro_batch_size: int,
                forward_only: bool, lowering: Lowering) -> PlanMemory:
    """The model's PlanMemory for one plan and batch shape (runtime/memory/buffer_pool.py,
    runtime/graphs/cell_graphs.py); the least recently used goes beyond POOLS_PER_MODEL. A new one
    builds and validates the schedule: a bad one raises ScheduleError before any message."""
    kept = model.__dict__.setdefault("_terapipe_pools", OrderedDict())
    key = (plan, num_microbatches, num_stages, micro_batch_size, forward_only, lowering)
    memory = kept.pop(key, None)
    if memory is None:
        memory = PlanMemory(build_lowered_schedule(plan, num_microbatches, num_stages,
                                                   micro_batch_size, forward_only, lowering),
                            BufferPool())
        terapipe = run_config(config)
        if terapipe.cuda_graphs:
            factory = terapipe.graph_factory or cuda_graph_factory(device)
            memory.graphs = CellGraphs(factory)
    kept[key] = memory
    while len(kept) > POOLS_PER_MODEL:
        kept.popitem(last=False)
    return memory


def _model_chunks(model, data_iterator) -> tuple[list, list]:
    """The stage's model chunks and one data iterator per chunk (Megatron's interleaved schedule
    takes both as lists; one model takes one iterator)."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if not models:
        raise ValueError("TeraPipe: model is an empty list: give the stage's model (chunks)")
    if data_iterator is None:
        return models, [None] * len(models)
    if not isinstance(data_iterator, (list, tuple)):
        if len(models) > 1:
            raise ValueError(
                f"TeraPipe: {len(models)} model chunks (virtual pipeline stages) need one data "
                "iterator per chunk, as Megatron's interleaved schedule takes them: pass "
                "data_iterator as a list")
        return models, [data_iterator]
    if len(data_iterator) != len(models):
        raise ValueError(
            f"TeraPipe: {len(data_iterator)} data iterators for {len(models)} model chunks: give "
            "one per chunk")
    return models, list(data_iterator)


def _process_groups(pg_collection):
    return pg_collection if pg_collection is not None else compat.default_pg_collection()


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _stage_options(config, tp_size: int, forward_only: bool,
                   collect_non_loss_data: bool) -> StageOptions:
    return StageOptions(
        hidden_size=config.hidden_size,
        seq_divisor=tp_size if getattr(config, "sequence_parallel", False) else 1,
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        per_token_loss=config.calculate_per_token_loss, grad_scale_func=config.grad_scale_func,
        autocast=getattr(config, "enable_autocast", False),
        autocast_dtype=getattr(config, "autocast_dtype", None),
        deallocate_outputs=getattr(config, "deallocate_pipeline_outputs", False),
        no_sync_func=config.no_sync_func or contextlib.nullcontext,
        grad_sync_func=None if forward_only else config.grad_sync_func)


def _stage_model(model: torch.nn.Module, forward_step_func: Callable,
                 first_val_step: Optional[bool], forward_only: bool) -> StageModel:
    """The model with Megatron's hooks: input tensors through set_input_tensor, and before each
    forward its first-microbatch flag and current microbatch, as Megatron's schedules set them."""
    from megatron.core.utils import get_attr_wrapped_model

    def before_forward(cell: Cell) -> None:
        first_cell = cell.microbatch == 0 and cell.batch_slice == 0 and cell.token_slice == 0
        if (compat.check_first_val_step(first_val_step, forward_only, first_cell)
                and hasattr(model, "set_is_first_microbatch")):
            model.set_is_first_microbatch()
        compat.set_current_microbatch(model, cell.microbatch)

    return StageModel(model, forward_step_func, get_attr_wrapped_model(model, "set_input_tensor"),
                      before_forward)


def resolve_plan(source, seq_length: int, micro_batch_size: int) -> TeraPipePlan:
    """The plan for this batch from `source` (TeraPipeConfig.plan: a plan, or a provider with
    plan_for(seq, mbs))."""
    if source is None:
        raise ValueError(
            "TeraPipe: no plan is configured for this model: call "
            "megatron_terapipe.configure(config, TeraPipePlan(...)), or pass "
            "--pipeline-schedule terapipe (slices from --terapipe-slices, --terapipe-num-slices "
            "or the DP slicer on --terapipe-cost-model)")
    if isinstance(source, TeraPipePlan):
        return source
    return source.plan_for(seq_length, micro_batch_size)


def check_run(config, models: List[torch.nn.Module], plan: TeraPipePlan, groups,
              seq_length: int, micro_batch_size: int, num_microbatches: int,
              decoder_seq_length: Optional[int], adjust_tensor_shapes_fn) -> None:
    """Everything that would make the run wrong or hang, raised before any communication.
    Changes nothing (prepare_model hooks the model). `models`: the stage's model chunks."""
    check_replaced_attributes(config)
    if num_microbatches <= 0:
        raise ValueError(f"TeraPipe: num_microbatches must be positive, got {num_microbatches}")
    check_support(config, models, groups, seq_length, decoder_seq_length, adjust_tensor_shapes_fn,
                  plan)
    tp_size = groups.tp.size() if groups.tp is not None else 1
    multiple = tp_size if getattr(config, "sequence_parallel", False) else 1
    plan.validate(seq_length, micro_batch_size, multiple_of=multiple)
    if plan.virtual_placement == "v":
        pp = groups.pp
        check_v_chunks(config, models, pp.rank() if pp is not None else 0,
                       pp.size() if pp is not None else 1, plan.chunk_layers)


def check_support(config, model, groups=None, seq_length: Optional[int] = None,
                  decoder_seq_length: Optional[int] = None, adjust_tensor_shapes_fn=None,
                  plan: Optional[TeraPipePlan] = None) -> None:
    """The support rules (support/refusals.py) on the model's config and what only this call knows: the
    context-parallel group, the model chunks (`model`: one module or the list of chunks) and
    the plan's, Megatron DDP's overlap_grad_reduce, the shapes."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    view = config_view(config, models[0])
    cp = groups.cp if groups is not None else None
    check_view(replace(
        view, context_parallel=cp.size() if cp is not None else view.context_parallel,
        seq_length=seq_length, decoder_seq_length=decoder_seq_length,
        adjust_tensor_shapes=adjust_tensor_shapes_fn is not None,
        model_chunks=len(models), plan_virtual_stages=plan.virtual_stages if plan else None,
        overlap_grad_reduce=any(getattr(getattr(m, "ddp_config", None), "overlap_grad_reduce",
                                        False) for m in models)))


def prepare_model(model: torch.nn.Module) -> None:
    """Check the model's attention and hook its RoPE offsets, linear layers and MoE routers;
    one walk per model, not per call (forward_backward_terapipe calls it after check_run)."""
    if getattr(model, "_terapipe_prepared", False):
        return
    layers = [m for m in model.modules() if isinstance(m, SliceAttention)]
    if not layers:
        raise ValueError(
            "TeraPipe: the model was built without the slice-aware attention: build GPTModel "
            "with transformer_layer_spec=megatron_terapipe.get_gpt_layer_spec()")
    for module in layers:
        kind = getattr(module.attn_mask_type, "name", str(module.attn_mask_type))
        if kind not in ("causal", "padding_causal", "None"):
            raise ValueError(
                f"TeraPipe needs causal self-attention, but layer {module.layer_number} uses "
                f"attn_mask_type={kind}: token slices cannot see later tokens; keep the "
                "spec's causal mask type or use Megatron's own schedule")
    install_rope_offsets(model)
    install_wgrad_deferral(model)
    moe_router_losses.install_moe_losses(model)
    model._terapipe_prepared = True
