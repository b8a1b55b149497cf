"""The TeraPipe schedule entry point, with the signature of Megatron's built-in schedules.

`forward_backward_terapipe` builds the per-stage action lists (schedule.py) for the configured
plan, checks that the plan fits the run, and runs this stage's list: forward and backward of each
cell, with point-to-point transfers to the neighbouring stages (comm.py).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Union

import torch

from .attention import KVCache, install_rope_offsets, running_cell
from .batching import CellData, slice_tensor
from .transport import Transport, make_transport
from ..plan import TeraPipePlan
from ..schedule import Action, Cell, Schedule, build_schedule
from .wgrad import WeightGradStore, install_wgrad_deferral


@dataclass
class CellEvent:
    """Wall-clock span of one action on this rank (for traces and simulator fidelity)."""

    stage: int
    kind: str
    cell: Cell
    start: float
    end: float


@dataclass
class RunRecord:
    schedule: Optional[Schedule] = None
    stage: int = 0
    events: list[CellEvent] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    deferred_wgrads: int = 0  # weight-gradient pieces the linear layers left to W actions
    receives: int = 0  # activations and gradients this stage received (torch transport)
    receives_posted_early: int = 0  # of which the receive was posted before it was needed


#: Timings of the most recent call on this process.
LAST_RUN = RunRecord()


def _groups(pg_collection):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is not None:
        return pg_collection
    pgc = ProcessGroupCollection()
    pgc.tp = parallel_state.get_tensor_model_parallel_group()
    pgc.cp = parallel_state.get_context_parallel_group()
    pgc.pp = parallel_state.get_pipeline_model_parallel_group()
    pgc.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgc.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgc.dp_cp = parallel_state.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=False)
    return pgc


def resolve_plan(config, seq_length: int, micro_batch_size: int) -> TeraPipePlan:
    """The plan attached by `configure` (a plan, or a provider with plan_for(seq, mbs))."""
    source = getattr(config, "terapipe_plan", None)
    if source is None:
        from ..megatron.install import default_plan_source

        source = default_plan_source()
    if source is None:
        raise ValueError(
            "TeraPipe: no plan is configured for this model: call "
            "megatron_terapipe.configure(config, TeraPipePlan(...)), or pass "
            "--pipeline-schedule terapipe (slices from --terapipe-slices, --terapipe-num-slices "
            "or the DP slicer on --terapipe-cost-model)")
    if isinstance(source, TeraPipePlan):
        return source
    return source.plan_for(seq_length, micro_batch_size)


def check_run(config, model: torch.nn.Module, plan: TeraPipePlan, seq_length: int,
              micro_batch_size: int, num_microbatches: int, tp_size: int, cp_size: int,
              decoder_seq_length: Optional[int], adjust_tensor_shapes_fn) -> None:
    """Everything that would make the run wrong or hang, raised before any communication."""
    from ..megatron.install import check_config

    if num_microbatches <= 0:
        raise ValueError(f"TeraPipe: num_microbatches must be positive, got {num_microbatches}")
    check_config(config, None, cp_size=cp_size)
    if decoder_seq_length is not None and decoder_seq_length != seq_length:
        raise ValueError("TeraPipe supports decoder-only GPT models: decoder_seq_length must be unset")
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("TeraPipe derives tensor shapes from the plan: adjust_tensor_shapes_fn "
                         "is not supported")
    multiple = tp_size if getattr(config, "sequence_parallel", False) else 1
    plan.validate(seq_length, micro_batch_size, multiple_of=multiple)
    prepare_model(model)


def prepare_model(model: torch.nn.Module) -> None:
    """Check the model's attention and hook its RoPE offsets; one walk per model, not per call."""
    if getattr(model, "_terapipe_prepared", False):
        return
    from .attention import SliceAttention

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
    model._terapipe_prepared = True


class _StageExecutor:
    """Runs one stage's action list."""

    def __init__(self, *, schedule: Schedule, stage: int, forward_step_func: Callable,
                 data: CellData, model: torch.nn.Module, config, transport: Transport,
                 forward_only: bool, collect_non_loss_data: bool, hidden_size: int,
                 seq_divisor: int, first_val_step: Optional[bool]) -> None:
        self.schedule = schedule
        self.stage = stage
        self.num_stages = schedule.num_stages
        self.is_first = stage == 0
        self.is_last = stage == schedule.num_stages - 1
        self.forward_step_func = forward_step_func
        self.data = data
        self.model = model
        self.config = config
        self.transport = transport
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.hidden_size = hidden_size
        self.seq_divisor = seq_divisor
        self.first_val_step = first_val_step
        self.num_microbatches = schedule.num_microbatches
        self.cells_per_microbatch = schedule.plan.num_cells
        self.cache = KVCache(seq_length=data.seq_length)
        from megatron.core.utils import get_attr_wrapped_model

        self.set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
        self.inputs: dict[Cell, Optional[torch.Tensor]] = {}
        self.outputs: dict[Cell, Any] = {}
        # Last stage: per-microbatch loss bookkeeping.
        self.cell_loss: dict[Cell, tuple[torch.Tensor, bool, float]] = {}
        self.mb_tokens: dict[int, torch.Tensor] = {}
        self.mb_weight: dict[int, float] = {}
        self.mb_reports: dict[int, list[tuple[Any, float]]] = {}
        self.mb_forwarded: dict[int, int] = {}
        self.forward_data_store: list[Any] = []
        self.device = transport_device(model)
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.events: list[CellEvent] = []
        # Linear layers defer weight gradients to the schedule's W actions when it has them.
        self.wgrad = WeightGradStore() if schedule.defer_wgrad else None

    # -- shapes ----------------------------------------------------------------------------
    def activation_shape(self, cell: Cell) -> tuple[int, int, int]:
        return (cell.tokens // self.seq_divisor, cell.rows, self.hidden_size)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, cell: Cell, input_tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        config = self.config
        if input_tensor is not None and not self.forward_only:
            input_tensor.requires_grad_(True)
        self.set_input_tensor([input_tensor])
        from megatron.core.pipeline_parallel.schedules import check_first_val_step

        first_cell = cell.microbatch == 0 and cell.batch_slice == 0 and cell.token_slice == 0
        if (check_first_val_step(self.first_val_step, self.forward_only, first_cell)
                and hasattr(self.model, "set_is_first_microbatch")):
            self.model.set_is_first_microbatch()
        _set_current_microbatch(self.model, cell.microbatch)
        autocast = (torch.autocast(self.device.type, dtype=config.autocast_dtype)
                    if getattr(config, "enable_autocast", False) else contextlib.nullcontext())
        with running_cell(cell, self.cache, "forward", keep_grad=not self.forward_only,
                          wgrad=self.wgrad), autocast:
            output, loss_func = self.forward_step_func(self.data.iterator_for(cell), self.model)
        m = cell.microbatch
        self.mb_forwarded[m] = self.mb_forwarded.get(m, 0) + 1
        mb_done = self.mb_forwarded[m] == self.cells_per_microbatch
        if self.forward_only and cell.is_last_token_slice:
            self.cache.release_sequence(cell)
        if self.is_last:
            self._loss(cell, output, loss_func, mb_done)
        else:
            expected = self.activation_shape(cell)
            if not isinstance(output, torch.Tensor) or tuple(output.shape) != expected:
                got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
                raise ValueError(
                    f"TeraPipe: forward_step_func returned {got} for cell {cell} on stage "
                    f"{self.stage}, but the plan predicts [tokens, rows, hidden] = {list(expected)}: "
                    "the model's output must be the stage's hidden states for the given slice")
        if mb_done:
            self.data.release(m)
        if not self.forward_only:
            # Kept until this cell's backward: the input for its gradient, the output as root.
            self.inputs[cell] = input_tensor
            if not self.is_last:
                self.outputs[cell] = output
        return None if self.is_last else output

    def _loss(self, cell: Cell, output, loss_func, mb_done: bool) -> None:
        m = cell.microbatch
        if loss_func is None:
            self.forward_data_store.append(output)
            return
        if self.collect_non_loss_data:
            self.forward_data_store.append(loss_func(output, non_loss_data=True))
            return
        outputs = loss_func(output)
        if len(outputs) == 3:
            loss, num_tokens, report = outputs
            num_tokens = torch.as_tensor(num_tokens, device=self.total_num_tokens.device)
            self.mb_tokens[m] = self.mb_tokens.get(m, 0) + num_tokens
            self.total_num_tokens += num_tokens.to(self.total_num_tokens.dtype)
            weight = 1.0
            per_token = True
        elif len(outputs) == 2:
            # Legacy losses are means over the cell's tokens: weight each cell by its share of
            # the microbatch's (loss-masked) tokens so the result is the whole-microbatch mean.
            loss, report = outputs
            weight = self._token_weight(cell)
            self.mb_weight[m] = self.mb_weight.get(m, 0.0) + weight
            per_token = False
        else:
            raise ValueError(
                f"TeraPipe: loss_func returned {len(outputs)} values; expected "
                "(loss, num_tokens, report) or (loss, report)")
        if not self.forward_only:
            self.cell_loss[cell] = (loss, per_token, weight)
        self.mb_reports.setdefault(m, []).append((report, weight))
        if mb_done:
            self.forward_data_store.append(self._merge_reports(m, per_token))

    def _token_weight(self, cell: Cell) -> float:
        batch = self.data._batches.get(cell.microbatch)
        if isinstance(batch, dict) and isinstance(batch.get("loss_mask"), torch.Tensor):
            mask = slice_tensor(batch["loss_mask"], cell, self.data.seq_length,
                                self.data.micro_batch_size)
            return float(mask.float().sum())
        return float(cell.rows * cell.tokens)

    def _merge_reports(self, m: int, per_token: bool) -> Any:
        reports = self.mb_reports.pop(m)
        total_weight = self.mb_weight.get(m, 1.0) if not per_token else 1.0
        scale = (lambda w: 1.0) if per_token else (lambda w: w / max(total_weight, 1e-30))

        def combine(values: list[tuple[Any, float]]):
            first = values[0][0]
            if isinstance(first, dict):
                return {k: combine([(v[k], w) for v, w in values]) for k in first}
            if isinstance(first, torch.Tensor):
                return sum(v * scale(w) for v, w in values)
            if isinstance(first, (int, float)):
                return sum(v * scale(w) for v, w in values)
            return [v for v, _ in values]

        return combine(reports)

    # -- backward --------------------------------------------------------------------------
    def backward(self, cell: Cell, output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        config = self.config
        input_tensor = self.inputs.pop(cell, None)
        if self.is_last:
            loss, per_token, weight = self.cell_loss.pop(cell)
            m = cell.microbatch
            if per_token:
                if not config.calculate_per_token_loss:
                    loss = loss / torch.clamp(self.mb_tokens[m], min=1) / self.num_microbatches
            else:
                loss = loss * (weight / max(self.mb_weight[m], 1e-30)) / self.num_microbatches
            if config.grad_scale_func is not None:
                loss = config.grad_scale_func(loss)
            roots, grads = loss, None
        else:
            roots, grads = self.outputs.pop(cell), output_grad
        with running_cell(cell, self.cache, "backward", wgrad=self.wgrad):
            if roots.requires_grad:
                torch.autograd.backward(roots, grad_tensors=grads)
        self.cache.release_slice(cell)
        if input_tensor is None:
            return None
        grad = input_tensor.grad
        if grad is None:
            grad = torch.zeros_like(input_tensor)
        return grad

    # -- the loop ----------------------------------------------------------------------------
    def run(self, no_sync_func, grad_sync_func) -> list[Any]:
        actions = self.schedule.stages[self.stage]
        last_backward = max((i for i, a in enumerate(actions) if a.kind == "B"), default=-1)
        no_sync_context = None

        def disable_grad_sync():
            nonlocal no_sync_context
            if no_sync_context is None:
                no_sync_context = no_sync_func()
                no_sync_context.__enter__()

        def enable_grad_sync():
            nonlocal no_sync_context
            if no_sync_context is not None:
                no_sync_context.__exit__(None, None, None)
                no_sync_context = None

        if not self.forward_only:
            disable_grad_sync()
        pending_input: Optional[torch.Tensor] = None
        pending_grad: Optional[torch.Tensor] = None
        # For each action, the next forward that receives an input and the next backward that
        # receives a gradient: their receives are posted before this action computes.
        next_recv = {"F": [None] * len(actions), "B": [None] * len(actions)}
        upcoming = {"F": None, "B": None}
        for i in range(len(actions) - 1, -1, -1):
            next_recv["F"][i], next_recv["B"][i] = upcoming["F"], upcoming["B"]
            if actions[i].kind in upcoming:
                upcoming[actions[i].kind] = actions[i].cell

        def prefetch(i: int) -> None:
            if not self.is_first and next_recv["F"][i] is not None:
                self.transport.prefetch_forward(self.activation_shape(next_recv["F"][i]))
            if not self.is_last and next_recv["B"][i] is not None:
                self.transport.prefetch_backward(self.activation_shape(next_recv["B"][i]))

        clock = time.perf_counter
        for i, action in enumerate(actions):
            cell = action.cell
            nxt: Optional[Action] = actions[i + 1] if i + 1 < len(actions) else None
            t0 = clock()
            if action.kind == "W":
                self.wgrad.flush(cell.sequence_key)
                self.events.append(CellEvent(self.stage, "W", cell, t0, clock()))
                continue
            if action.kind == "F":
                if self.is_first:
                    inp = None
                elif pending_input is not None:
                    inp, pending_input = pending_input, None
                else:
                    inp = self.transport.recv_forward(self.activation_shape(cell))
                prefetch(i)
                t0 = clock()
                out = self.forward(cell, inp)
                t1 = clock()
                if not self.is_last:
                    if nxt is not None and nxt.kind == "B":
                        pending_grad = self.transport.send_forward_recv_backward(
                            out, self.activation_shape(nxt.cell))
                    else:
                        self.transport.send_forward(out)
            else:
                if self.is_last:
                    grad = None
                elif pending_grad is not None:
                    grad, pending_grad = pending_grad, None
                else:
                    grad = self.transport.recv_backward(self.activation_shape(cell))
                if i == last_backward and (grad_sync_func is None or self.is_first):
                    enable_grad_sync()
                prefetch(i)
                t0 = clock()
                grad_in = self.backward(cell, grad)
                t1 = clock()
                if not self.is_first:
                    if nxt is not None and nxt.kind == "F":
                        pending_input = self.transport.send_backward_recv_forward(
                            grad_in, self.activation_shape(nxt.cell))
                    else:
                        self.transport.send_backward(grad_in)
            self.events.append(CellEvent(self.stage, action.kind, cell, t0, t1))
        self.transport.finish()
        if not self.forward_only and no_sync_context is not None:
            enable_grad_sync()
            if grad_sync_func is not None:
                grad_sync_func(self.model.parameters())
        if len(self.cache):
            raise RuntimeError(f"TeraPipe: K/V cache of {len(self.cache)} sequences left after the run")
        if self.wgrad is not None and len(self.wgrad):
            raise RuntimeError(f"TeraPipe: weight gradients of {len(self.wgrad)} sequences were "
                               "never computed (the schedule lacks their W actions)")
        return self.forward_data_store


def transport_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _set_current_microbatch(model, microbatch: int) -> None:
    try:
        from megatron.core.pipeline_parallel.schedules import set_current_microbatch
    except ImportError:  # pragma: no cover
        return
    set_current_microbatch(model, microbatch)


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
) -> list[Any]:
    """Run forward and backward of `num_microbatches` microbatches with token-slice pipelining.

    Same keywords and return value as Megatron's built-in schedules: the list of what loss_func
    reported per microbatch on the last stage, [] elsewhere. The plan comes from
    `configure(config, plan)` unless given as `plan=`.
    """
    from megatron.core.utils import get_model_config

    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(
                f"TeraPipe does not support virtual pipeline stages ({len(model)} model chunks): "
                "drop --num-layers-per-virtual-pipeline-stage")
        model = model[0]
    if isinstance(data_iterator, list):
        if len(data_iterator) != 1:
            raise ValueError("TeraPipe takes one data iterator (no virtual pipeline stages)")
        data_iterator = data_iterator[0]
    config = get_model_config(model)
    pgc = _groups(pg_collection)
    if plan is None:
        plan = resolve_plan(config, seq_length, micro_batch_size)
    tp_size = pgc.tp.size() if pgc.tp is not None else 1
    cp_size = pgc.cp.size() if pgc.cp is not None else 1
    check_run(config, model, plan, seq_length, micro_batch_size, num_microbatches, tp_size,
              cp_size, decoder_seq_length, adjust_tensor_shapes_fn)

    pp_group = pgc.pp
    num_stages = pp_group.size() if pp_group is not None else 1
    stage = pp_group.rank() if pp_group is not None else 0
    schedule = build_schedule(plan, num_microbatches, num_stages, micro_batch_size, forward_only)
    device = transport_device(model)
    is_first, is_last = stage == 0, stage == num_stages - 1
    transport = make_transport(pp_group, config, device, is_first, is_last, p2p_communicator) \
        if num_stages > 1 else Transport()
    seq_divisor = tp_size if getattr(config, "sequence_parallel", False) else 1

    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    executor = _StageExecutor(
        schedule=schedule, stage=stage, forward_step_func=forward_step_func,
        data=CellData(data_iterator, seq_length, micro_batch_size), model=model, config=config,
        transport=transport, forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        hidden_size=config.hidden_size, seq_divisor=seq_divisor, first_val_step=first_val_step)
    no_sync_func = config.no_sync_func or contextlib.nullcontext
    grad_sync_func = None if forward_only else config.grad_sync_func
    start = time.perf_counter()
    result = executor.run(no_sync_func, grad_sync_func)
    end = time.perf_counter()
    global LAST_RUN
    LAST_RUN = RunRecord(schedule, stage, executor.events, start, end,
                         executor.wgrad.deferred if executor.wgrad is not None else 0,
                         getattr(transport, "receives", 0),
                         getattr(transport, "receives_posted_early", 0))

    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            [model],
            executor.total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pgc,
            force_all_reduce=force_all_reduce,
        )
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return result
