"""Running one pipeline stage's lowered action list (schedule/lower.py).

The executor is one loop over the lowered actions. Compute actions run a cell's forward,
backward or deferred weight gradients; communication actions move what a compute action left
in the outbox to the neighbour, or put what arrived into the inbox for the compute that uses
it. Everything Megatron-specific (process groups, the model config, Megatron's per-microbatch
hooks, gradient finalisation) is the caller's: megatron/hooks/forward_backward.py.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from ..schedule import (Action, Cell, LoweredSchedule, Schedule, TimedAction, format_action,
                        opposite)
from ..schedule.actions import last_virtual_stage
from ..schedule.routes import hands_over_locally, message_route, turned_cell
from .batching import CellData
from .memory.buffer_pool import BufferPool
from .context import current_action_or_outside, running_action, running_cell
from .comm.grad_sync import GradSync, SyncFunc
from .graphs.cell_graphs import CellGraphs
from .attention.kv_cache import KVCache
from .loss import LossBook
from .stage_setup import check_v_shape, lowered_for, per_chunk
from .trace import RunRecord
from .comm.transport import Transport
from .wgrad.store import WeightGradStore


@dataclass(frozen=True)
class StageOptions:
    """What the run asks of a stage (the Megatron glue reads it off the model config)."""

    hidden_size: int
    seq_divisor: int = 1  # sequence parallelism: a stage's activations hold tokens / TP
    forward_only: bool = False
    collect_non_loss_data: bool = False
    per_token_loss: bool = False  # the loss is not divided by the microbatch's token count
    grad_scale_func: Optional[Callable] = None
    autocast: bool = False
    autocast_dtype: Optional[torch.dtype] = None
    # Megatron's deallocate_pipeline_outputs: free a stage output's data once it is sent.
    deallocate_outputs: bool = False
    # one callable, or one per model chunk (comm/grad_sync.py)
    no_sync_func: SyncFunc = contextlib.nullcontext
    grad_sync_func: SyncFunc = None


@dataclass
class StageModel:
    """The stage's model as the executor drives it."""

    module: torch.nn.Module
    forward_step_func: Callable  # forward_step_func(data_iterator, module) -> (output, loss_func)
    set_input_tensor: Callable[[list], None]
    before_forward: Callable[[Cell], None] = lambda cell: None  # e.g. Megatron's microbatch hooks


class StageExecutor:
    """Runs one stage's lowered list; `run()` returns the loss reports (last stage) and leaves
    the RunRecord in `record`.

    `schedule`: the schedule already validated and lowered for the transport (built once per
    plan and batch shape, schedule/build.py); a plain Schedule is validated and lowered here.
    `model`, `data`: the stage's StageModel and CellData, or one of each per model chunk (a
    plan with virtual_stages V > 1)."""

    def __init__(self, schedule: Union[LoweredSchedule, Schedule], stage: int,
                 model: Union[StageModel, Sequence[StageModel]],
                 data: Union[CellData, Sequence[CellData]], transport: Transport,
                 options: StageOptions, device: torch.device, pool: Optional[BufferPool] = None,
                 graphs: Optional[CellGraphs] = None) -> None:
        lowered = lowered_for(schedule, transport)
        check_v_shape(lowered.schedule, transport, graphs)
        schedule = lowered.schedule
        self.models, self.chunk_data = per_chunk(schedule, model, data)
        self.schedule, self.stage = schedule, stage
        self.model, self.data = self.models[0], self.chunk_data[-1]  # the loss reads the last's
        self.graphs = graphs  # CUDA graphs per compute action (graphs/cell_graphs.py), kept with the pool
        self.transport, self.options, self.device = transport, options, device
        self.actions = lowered.stage(stage)
        self.K = schedule.num_stages
        self.is_first, self.is_last = stage == 0, stage == self.K - 1
        # One pool kept across iterations (the caller's) puts every buffer cells read across
        # their boundary at fixed addresses: K/V, received messages, staged data, loss totals.
        self.pool = pool if pool is not None else BufferPool()
        self.pool.label_of = current_action_or_outside
        transport.pool = self.pool
        for chunk_data in self.chunk_data:
            if chunk_data.pool is None:
                chunk_data.pool = self.pool
        self.loss = LossBook(self.data, schedule.num_microbatches, device, options.collect_non_loss_data,
                             keep_for_backward=not options.forward_only, pool=self.pool)
        # Received buffers a sequence's deferred pieces may still read, until its W action.
        self.held: dict[tuple, list[Optional[torch.Tensor]]] = {}
        self.cache = KVCache(seq_length=self.data.seq_length, pool=self.pool)
        # Linear layers defer weight gradients to the schedule's W actions when it has them.
        self.wgrad = WeightGradStore() if schedule.defer_wgrad else None
        self.grad_sync = GradSync(options.no_sync_func, options.grad_sync_func, self.actions,
                                  schedule.defer_wgrad, first_stage=self.is_first)
        self.inputs: dict[Cell, Optional[torch.Tensor]] = {}  # kept for their gradient
        self.outputs: dict[Cell, torch.Tensor] = {}  # the backward roots of non-last stages
        self.outbox: dict[tuple[str, Cell], torch.Tensor] = {}  # results waiting for a SEND
        self.inbox: dict[tuple[str, Cell], torch.Tensor] = {}  # messages waiting for a compute
        self.forwarded: dict[tuple[int, int], int] = {}  # cells forwarded per (chunk, microbatch)
        self.outputs_sent: dict[str, int] = {}  # forward messages sent so far, per route
        self.output_send_position: dict[Cell, int] = {}  # until the cell's gradient is back
        self.record = RunRecord(schedule, stage, self.actions)
        self._run_action = {"F": self._compute, "B": self._compute, "W": self._weight_grads,
                            "SEND": self._send, "RECV": self._recv, "POST": self._post,
                            "SEND_RECV": self._send_recv}

    def run(self) -> list[Any]:
        self.record.start = time.perf_counter()
        if self.graphs is not None:
            self.graphs.start_iteration(self._named_parameters())
        if not self.options.forward_only:
            self.grad_sync.pause()
        for action in self.actions:
            self._run_action[action.operation](action)
        self.transport.finish()
        if not self.options.forward_only:
            self.grad_sync.at_end([m.module for m in self.models])
        self._release_run_buffers()
        if self.graphs is not None:
            self.graphs.end_iteration(self._named_parameters())
        if len(self.cache):
            raise RuntimeError(f"TeraPipe: K/V cache of {len(self.cache)} sequences left after the run")
        if self.wgrad is not None and len(self.wgrad):
            raise RuntimeError(f"TeraPipe: weight gradients of {len(self.wgrad)} sequences were "
                               "never computed (the schedule lacks their W actions)")
        record = self.record
        record.end = time.perf_counter()
        record.deferred_wgrads = self.wgrad.deferred if self.wgrad is not None else 0
        record.receives = self.transport.receives
        record.receives_posted_early = self.transport.receives_posted_early
        record.received_elements = self.transport.received_elements
        return self.loss.results

    def _named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Every chunk's parameters; on virtual stages named chunk<c>.<name> (chunks share
        their modules' names)."""
        for c, model in enumerate(self.models):
            prefix = f"chunk{c}." if len(self.models) > 1 else ""
            for name, param in model.module.named_parameters():
                yield prefix + name, param

    def activation_shape(self, cell: Cell) -> tuple[int, int, int]:
        return (cell.tokens // self.options.seq_divisor, cell.rows, self.options.hidden_size)

    def _release_run_buffers(self) -> None:
        """Pooled buffers whose last reader has run; the loss total stays readable (for
        finalize_model_grads) until the next iteration takes it again."""
        for chunk_data in self.chunk_data:
            chunk_data.release_staged()
        self.pool.give_back(self.loss.total_num_tokens)
        if self.pool.chunks_reading_data is None:
            self.pool.chunks_reading_data = tuple(d.read_any for d in self.chunk_data)

    # -- compute actions ------------------------------------------------------------------------
    def _compute(self, action: Action) -> None:
        """F or B: run the cell on what arrived for it (nothing on the model's first virtual
        stage's forwards and its last one's backwards) and leave the result for its SEND."""
        cell = action.cell
        chunk = _chunk(cell)
        sync = self.grad_sync.before(action)
        if (action.kind == "F" and not self.forwarded.get((chunk, cell.microbatch))
                and self.pool.chunks_reading_data and self.pool.chunks_reading_data[chunk]):
            self.chunk_data[chunk].prefetch(cell.microbatch)  # outside the cell, at a fixed address
        received = self.inbox.pop((action.kind, cell), None)
        held = [received, self.inputs.get(cell)] if action.kind == "B" else [received]
        start = time.perf_counter()
        run_cell = self._forward_cell if action.kind == "F" else self._backward_cell
        with running_action(action.kind, cell):
            if self.graphs is None:
                result = run_cell(cell, received)
            else:
                result = self._graphed(action, lambda: run_cell(cell, received), received)
        if result is not None and hands_over_locally(cell, action.kind, self.stage, self.K):
            # a V's turn: chunk 0's output is chunk 1's input (a leaf of its own), chunk 1's
            # input gradient chunk 0's output gradient, with no message
            self.inbox[(action.kind, turned_cell(cell))] = result.detach()
        elif result is not None:
            self.outbox[(action.kind, cell)] = result
        if action.kind == "B" and self.wgrad is not None:
            self.held.setdefault(cell.sequence_key, []).extend(held)
        elif action.kind == "B" or self.options.forward_only:
            self._give_back(held)
        if sync:
            self.grad_sync.pause()
        self._record_span(action, start)

    def _give_back(self, tensors: list[Optional[torch.Tensor]]) -> None:
        for tensor in tensors:
            self.pool.give_back(tensor)

    def _weight_grads(self, action: Action) -> None:
        """A sequence's deferred weight gradients on its chunk (the store is keyed by the
        cell's sequence key, which names the chunk)."""
        sync = self.grad_sync.before(action)
        start = time.perf_counter()
        with running_action("W", action.cell):
            if self.graphs is None:
                self.wgrad.flush(action.cell.sequence_key)
            else:
                self._graphed(action, lambda: self.wgrad.flush(action.cell.sequence_key), None)
        self._give_back(self.held.pop(action.cell.sequence_key, []))
        if sync:
            self.grad_sync.pause()
        self._record_span(action, start)

    def _graphed(self, action: Action, run: Callable[[], Any], received: Optional[torch.Tensor]) -> Any:
        """Run a compute action through its graph. A replay runs nothing inside the cell, so
        the executor's own bookkeeping of a forward is done here: its count, the data it
        released, its input kept for the backward, the loss reports it appended at capture."""
        key = format_action(action)
        reports_before = len(self.loss.results)
        result, replayed = self.graphs.run(key, run)
        if not replayed:
            if self.graphs.captured(key):
                self.graphs.reports[key] = self.loss.results[reports_before:]
            return result
        self.loss.results.extend(self.graphs.reports.get(key, []))
        cell = action.cell
        if action.kind == "F":
            self._count_forward(cell)
            if not self.options.forward_only:
                self.inputs[cell] = received
        elif action.kind == "B":
            self.inputs.pop(cell, None)
        return result

    def _record_span(self, action: Action, start: float) -> None:
        self.record.events.append(TimedAction(self.stage, action, start, time.perf_counter()))

    # -- communication actions --------------------------------------------------------------------
    def _send(self, action: Action) -> None:
        tensor = self.outbox.pop((action.direction, action.cell))
        self.transport.send(message_route(action.cell, action.direction), tensor)
        self._after_send(action.direction, action.cell, tensor)

    def _recv(self, action: Action) -> None:
        shape = self.activation_shape(action.cell)
        route = message_route(action.cell, action.direction)
        self._received(action.direction, action.cell, self.transport.recv(route, shape))

    def _post(self, action: Action) -> None:
        self.transport.post(message_route(action.cell, action.direction),
                            self.activation_shape(action.cell))

    def _send_recv(self, action: Action) -> None:
        tensor = self.outbox.pop((action.direction, action.cell))
        shape = self.activation_shape(action.recv_cell)
        received = self.transport.send_recv(message_route(action.cell, action.direction),
                                            tensor, shape)
        self._after_send(action.direction, action.cell, tensor)
        self._received(opposite(action.direction), action.recv_cell, received)

    def _received(self, direction: str, cell: Cell, tensor: torch.Tensor) -> None:
        if self.graphs is not None and self.pool.slot_of(tensor) is None:
            # A transport's own buffer (Megatron's communicator): graphs read a pooled copy,
            # of the data only (its buffers require grad: a copy of one would be no leaf).
            static = self.pool.take(tuple(tensor.shape), tensor.dtype, tensor.device)
            tensor = static.copy_(tensor.detach())
        self.inbox[(direction, cell)] = tensor
        position = self.output_send_position.pop(cell, None) if direction == "B" else None
        if position is not None:
            # The next stage ran this cell's backward, so it has every output sent up to it.
            self.transport.peer_received(message_route(cell, "F"), position + 1)

    def _after_send(self, direction: str, cell: Cell, tensor: torch.Tensor) -> None:
        """A sent output: note its place in the send order (the transport lets it go when its
        gradient is back) and, as Megatron's deallocate_output_tensor, free its data: only its
        grad_fn (the backward root) is needed now."""
        if direction != "F":
            return
        route = message_route(cell, "F")
        self.output_send_position[cell] = self.outputs_sent.get(route, 0)
        self.outputs_sent[route] = self.output_send_position[cell] + 1
        if not self.options.deallocate_outputs or self.graphs is not None:
            return  # a graph's output lives in the graphs' pool: freeing its data frees nothing
        if tensor._base is not None:
            raise ValueError(
                "TeraPipe: deallocate_pipeline_outputs frees a stage's output after its send, "
                "but forward_step_func returned a view of another tensor: return a tensor of "
                "its own (Megatron's make_viewless_tensor) or unset deallocate_pipeline_outputs")
        tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)
        self.record.outputs_deallocated += 1

    # -- one cell's forward and backward ------------------------------------------------------------
    def _forward_cell(self, cell: Cell, input_tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Run the cell's chunk on it; returns the output to send (None on the model's last
        virtual stage, which computes the loss)."""
        options, model = self.options, self.models[_chunk(cell)]
        if input_tensor is not None and not options.forward_only:
            input_tensor.requires_grad_(True)
        model.set_input_tensor([input_tensor])
        model.before_forward(cell)
        autocast = (torch.autocast(self.device.type, dtype=options.autocast_dtype)
                    if options.autocast else contextlib.nullcontext())
        with running_cell(cell, self.cache, "forward", keep_grad=not options.forward_only,
                          wgrad=self.wgrad), autocast:
            output, loss_func = model.forward_step_func(
                self.chunk_data[_chunk(cell)].iterator_for(cell), model.module)
        if options.forward_only and cell.is_last_token_slice:
            self.cache.release_sequence(cell)
        last = last_virtual_stage(cell, self.stage, self.schedule.num_stages)
        if last:
            microbatch_done = self.forwarded.get((_chunk(cell), cell.microbatch), 0) + 1 == \
                self._cells_of(cell)
            self.loss.record(cell, output, loss_func, microbatch_done)
        else:
            self._check_output(cell, output)
        self._count_forward(cell)
        if not options.forward_only:
            # Kept until this cell's backward: the input for its gradient, the output as root.
            self.inputs[cell] = input_tensor
            if not last:
                self.outputs[cell] = output
        return None if last else output

    def _count_forward(self, cell: Cell) -> None:
        """One more forward of the cell's microbatch on its chunk; after the last, the chunk's
        data of that microbatch goes."""
        key = (_chunk(cell), cell.microbatch)
        self.forwarded[key] = self.forwarded.get(key, 0) + 1
        if self.forwarded[key] == self._cells_of(cell):
            self.chunk_data[key[0]].release(cell.microbatch)

    def _cells_of(self, cell: Cell) -> int:
        """Cells of the cell's microbatch (a plan's edge_slices cut some differently)."""
        return self.schedule.plan.cells_of(cell.microbatch, self.schedule.num_microbatches)

    def _check_output(self, cell: Cell, output: Any) -> None:
        expected = self.activation_shape(cell)
        if not isinstance(output, torch.Tensor) or tuple(output.shape) != expected:
            got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(
                f"TeraPipe: forward_step_func returned {got} for cell {cell} on stage "
                f"{self.stage}, but the plan predicts [tokens, rows, hidden] = {list(expected)}: "
                "the model's output must be the stage's hidden states for the given slice")

    def _backward_cell(self, cell: Cell, output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Backpropagate the cell; returns the gradient of its input (None on the first stage)."""
        options = self.options
        input_tensor = self.inputs.pop(cell, None)
        last = last_virtual_stage(cell, self.stage, self.schedule.num_stages)
        if last:
            root = self.loss.backward_root(cell, options.per_token_loss, options.grad_scale_func)
        else:
            root = self.outputs.pop(cell)
        with running_cell(cell, self.cache, "backward", wgrad=self.wgrad):
            if root.requires_grad:
                _backward(root, None if last else output_grad,
                          freed=options.deallocate_outputs and not last)
        self.cache.release_slice(cell)
        if input_tensor is None:
            return None
        return input_tensor.grad if input_tensor.grad is not None else torch.zeros_like(input_tensor)


def _backward(root: torch.Tensor, grad: Optional[torch.Tensor], freed: bool) -> None:
    """Backpropagate from `root`. A freed output (one element left) no longer matches its
    gradient's shape, which torch.autograd.backward checks: as Megatron's custom_backward, the
    autograd engine is then called directly."""
    if not freed:
        torch.autograd.backward(root, grad_tensors=grad)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(root,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


def _chunk(cell: Cell) -> int:
    """The model chunk a cell runs on (0 without virtual stages)."""
    return getattr(cell, "chunk", 0)
