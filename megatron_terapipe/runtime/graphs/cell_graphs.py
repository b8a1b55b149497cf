"""One CUDA graph per compute action of a fixed plan: captured once, replayed every iteration.

A token-sliced stage pays its host work per cell: on CPU each cell dispatches about as many
aten ops as a whole unsliced pass (benchmarks/bench_host_ops.py), so the host work grows with
the number of slices, and on a GPU it bounds the eager stage (docs/performance.md, "One GPU stage with token
slices"). A plan fixes every
cell's shape, and the buffer pool (memory/buffer_pool.py)
puts everything a cell reads across its boundary at the same address every iteration, so each
compute action (a cell's forward, its backward, a sequence's W action) can be captured once
and replayed: its host work then no longer grows with the number of slices.

Each action gets its own graph (the key is its label, "F(m0b0t1)"): forwards of different
microbatches are alive together and keep their saved activations in their graph's memory, so
they cannot share one. The graphs share one memory pool and are captured in the order they
run, one iteration after `warmup_iterations` eager ones (lazy set-up, the pool's first
allocations, cuBLAS workspaces), and then replayed in that same order.

What the executor does around a replay: a replayed action runs no Python inside the cell, so
the executor keeps its own bookkeeping (forward counts, receive buffers, the loss reports the
captured forward produced: `reports`) and the transports, data prefetch and gradient sync run
eagerly between graphs.

Why torch.cuda.CUDAGraph and not Megatron's CudaGraphManager (`--cuda-graph-impl local`):
Megatron's manager graphs each TransformerLayer call and ties it to autograd through its own
function, keyed on Megatron's microbatch order; a TeraPipe cell also runs the embedding, the
loss, the K/V cache's writes and the deferring layers' hand-over to the W store, and the W
actions run outside any layer. A graph per action holds all of it.

`graph_factory` makes the graphs: `cuda_graph_factory()` on a GPU; tests and CPU benchmarks use
`RecordingGraph`, which runs the action once at capture and records the ops it would capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CellGraph(Protocol):
    def capture(self, run: Callable[[], Any]) -> Any:
        """Capture `run()`'s device work; returns its result (tensors at the graph's addresses)."""

    def replay(self) -> None:
        ...


GraphFactory = Callable[[str], CellGraph]


@dataclass
class CellGraphs:
    """The graphs of one stage for one plan and batch shape (kept with its buffer pool).

    `start_iteration(parameters)` once per iteration, then `run(key, action)` for each compute
    action: eager during warm-up, captured (and replayed once, since a capture runs nothing) the
    first time after it, replayed afterwards. Returns (result, replayed). `end_iteration`
    notes, after the capture, which tensor each parameter's .grad is: the replays write there."""

    factory: GraphFactory
    warmup_iterations: int = 1
    graphs: dict[str, CellGraph] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)  # what each captured action returned
    reports: dict[str, list] = field(default_factory=dict)  # loss reports a forward appended
    iteration: int = 0
    #: After the capture, per parameter without Megatron DDP's main_grad, its .grad tensor.
    grad_homes: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)

    def start_iteration(self, parameters: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        """Count the iteration; once graphs replay, refuse gradients that moved (before any work)."""
        if self.grad_homes:
            for name, param in parameters:
                if name in self.grad_homes and param.grad is not self.grad_homes[name]:
                    raise ValueError(
                        f"TeraPipe: CUDA graphs (--terapipe-cuda-graphs) replay parameter "
                        f"gradients into the tensors the capture accumulated them in, but {name}"
                        f".grad was {'set to None' if param.grad is None else 'replaced'} since: "
                        "zero gradients in place (zero_grad(set_to_none=False)), or wrap the "
                        "model in Megatron's DistributedDataParallel (its main_grad is zeroed in place)")
        self.iteration += 1

    def end_iteration(self, parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.iteration == self.warmup_iterations + 1 and self.graphs:  # the capture iteration
            self.grad_homes = {name: param.grad for name, param in parameters
                               if getattr(param, "main_grad", None) is None}

    def run(self, key: str, action: Callable[[], Any]) -> tuple[Any, bool]:
        if self.iteration <= self.warmup_iterations:
            return action(), False
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return self.results[key], True
        graph = self.factory(key)
        result = graph.capture(action)
        graph.replay()
        self.graphs[key] = graph
        self.results[key] = result
        return result, False

    def captured(self, key: str) -> bool:
        return key in self.graphs


class _OpRecorder(TorchDispatchMode):
    def __init__(self, ops: list[str]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@dataclass
class RecordingGraph:
    """A stand-in for a CUDA graph on CPU: `capture` runs the action once and records the aten
    ops it dispatched (what a CUDA graph would hold); `replay` only counts (nothing runs)."""

    key: str
    ops: list[str] = field(default_factory=list)
    calls: int = 0  # captures: the action really ran
    replays: int = 0

    def capture(self, run: Callable[[], Any]) -> Any:
        self.calls += 1
        with _OpRecorder(self.ops):
            return run()

    def replay(self) -> None:
        self.replays += 1


class TorchCUDAGraph:
    """torch.cuda.CUDAGraph capturing one action into a memory pool shared by the stage's graphs.

    Not `with torch.cuda.graph(...)`: that synchronizes the whole device and empties the cache
    before every capture, and a stage captures in the middle of a pipelined iteration, where a
    receive posted ahead on the communication stream waits for a peer that waits for this
    stage's next send: the synchronize would never return. So the capture only orders its
    side stream after the current one. `thread_local`: other threads (the NCCL watchdog, the
    autograd engine's device thread) may make CUDA calls during a capture, as Megatron's own
    graphs allow."""

    def __init__(self, pool: Any, stream: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.stream = stream

    def capture(self, run: Callable[[], Any]) -> Any:
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                result = run()
            finally:
                self.graph.capture_end()
        current.wait_stream(self.stream)
        return result

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory(device: Optional[torch.device] = None) -> GraphFactory:
    """Graphs on the CUDA device the stage runs on; a clear error anywhere else."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        where = f"on {device}" if device is not None else "in a process that sees no CUDA device"
        raise ValueError(
            f"TeraPipe: CUDA graphs (--terapipe-cuda-graphs, configure(..., cuda_graphs=True)) "
            f"need a CUDA device, but the stage runs {where}: drop the option (on CPU, check "
            "that cells could be captured with megatron_terapipe.runtime.graphs.graph_audit."
            "audit_iterations)")
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    return lambda key: TorchCUDAGraph(pool, stream)
