"""A CPU stand-in for a CUDA graph that replays like one: fixed addresses, no Python.

A CUDA graph records the kernels of one capture and, on replay, runs them again on the same
memory: it reads whatever its input addresses hold now and writes where the capture wrote. No
Python runs, so anything a cell computes on the host, or reads from a tensor made anew outside
it, is frozen at capture. `ReplayGraph` does the same with aten ops, so that the numbers of a
graphed run can be checked against eager runs on a machine without a GPU:

- `capture(run)` runs the action once under a dispatch mode and keeps, per dispatched op, the
  op, its tensor arguments and its results (aliases of the very storages they used);
- `replay()` runs those ops again on those storages, in order, each result written into the
  storage its capture result had; views are not re-made (they alias storages that are) and
  in-place ops write where they wrote.

A capture runs the action, where a CUDA capture runs nothing, so the replay that follows each
capture (CellGraphs replays once after capturing) is skipped: memory then holds what capture
plus replay would leave on a GPU. Reading a value on the host inside the action is an error,
as it is under CUDA capture (unless the tensor was made there from Python values: on a GPU run
that is a host tensor, read without a sync). Host reads that dispatch no op (`tolist()`,
`numpy()` on a CPU tensor) are not seen: the capture audit's rules are the check for those. Random ops replay with the global generator: compare against eager
runs only without dropout.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

#: Ops that read a value on the host: a CUDA capture fails on them, and a replay could not redo them.
HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)
#: Results that are never read before being written: nothing to redo.
UNINITIALISED = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                 torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                 torch.ops.aten.new_empty_strided.default)


def _alias(value: Any) -> Any:
    """A tensor's storage at its place (a new Python object: `x.data = ...` on the original
    later does not move it), or the value itself."""
    return value.detach() if isinstance(value, torch.Tensor) else value


@dataclass
class _Step:
    """One dispatched op: what to call again, and where its fresh results go."""

    func: Any
    args: tuple
    kwargs: dict
    fresh: list[tuple[int, torch.Tensor]]  # (position among the flat results, where it was)

    def replay(self) -> None:
        results, _ = tree_flatten(self.func(*self.args, **self.kwargs))
        for result in results:
            # A collective's Work: its tensors are written once it is done (a stream orders
            # that on a GPU; gloo runs it on its own thread).
            if not isinstance(result, torch.Tensor) and hasattr(result, "wait"):
                result.wait()
        for position, target in self.fresh:
            target.copy_(results[position])


def _fresh_positions(func: Any, out: Any) -> list[int]:
    """Positions, among the flat results, of the new tensors (not views or in-place writes of
    inputs; a list result takes its return's annotation). c10d's collectives annotate nothing:
    their written tensors count as new, so that the replay writes them after the collective."""
    returns = func._schema.returns
    per_return = [out] if len(returns) == 1 else list(out)
    fresh, position = [], 0
    for declared, value in zip(returns, per_return):
        for result in tree_flatten(value)[0]:
            if isinstance(result, torch.Tensor) and declared.alias_info is None:
                fresh.append(position)
            position += 1
    return fresh


class _Recorder(TorchDispatchMode):
    def __init__(self, steps: list[_Step], key: str) -> None:
        super().__init__()
        self.steps = steps
        self.key = key
        self.thread = threading.get_ident()
        self.waiting = 0  # inside a collective's Work.wait()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.waiting or threading.get_ident() != self.thread:
            # A collective's own work, on its backend's thread (gloo carries the dispatch mode
            # there) or in its wait (gloo finishes a reduce-scatter there): the collective
            # redoes it when replayed.
            return func(*args, **kwargs)
        if func is torch.ops.aten.lift_fresh.default:
            # torch.tensor(<Python values>) without a device: a host tensor on a GPU run too,
            # whose value a capture may read (Megatron's selective recompute does .item() on one,
            # again when the backward's capture recomputes): the tensor is marked.
            args[0]._made_from_python_values = True
        elif func in HOST_READS and not getattr(args[0], "_made_from_python_values", False):
            raise RuntimeError(
                f"TeraPipe: {func} reads a tensor's value on the host inside the captured "
                f"action {self.key}: a CUDA graph capture fails there (run the capture audit, "
                "megatron_terapipe.runtime.graphs.graph_audit.audit_iterations, to find the line)")
        out = func(*args, **kwargs)
        if func in UNINITIALISED:
            return out
        if getattr(args[0] if args else None, "_made_from_python_values", False) and \
                isinstance(out, torch.Tensor) and func._schema.returns[0].alias_info is not None:
            out._made_from_python_values = True  # a view or detach of one: still Python values
        results, _ = tree_flatten(out)
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        fresh = [(p, _alias(results[p])) for p in _fresh_positions(func, out)]
        if fresh or mutates or func.namespace == "c10d":  # a send returns only its Work
            self.steps.append(_Step(func, tree_map(_alias, args), tree_map(_alias, kwargs), fresh))
        return out


@contextlib.contextmanager
def _waits_noted(recorder: _Recorder) -> Iterator[None]:
    """Count the recorder into every Work.wait() while it records."""
    if not torch.distributed.is_available():
        yield
        return
    work = torch.distributed.Work
    original = work.wait

    def wait(self, *args, **kwargs):
        recorder.waiting += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            recorder.waiting -= 1

    work.wait = wait
    try:
        yield
    finally:
        work.wait = original


@dataclass
class ReplayGraph:
    """A graph (runtime/graphs/cell_graphs.py's CellGraph) whose replays redo the captured ops on the
    captured storages, as a CUDA graph would: `configure(..., cuda_graphs=True,
    graph_factory=ReplayGraph)` runs a whole plan that way on CPU."""

    key: str
    steps: list[_Step] = field(default_factory=list)
    replays: int = 0
    _captured_now: bool = False

    def capture(self, run: Callable[[], Any]) -> Any:
        recorder = _Recorder(self.steps, self.key)
        with _waits_noted(recorder), recorder:
            result = run()
        self._captured_now = True
        return result

    def replay(self) -> None:
        self.replays += 1
        if self._captured_now:  # the capture ran the ops already (a CUDA capture runs none)
            self._captured_now = False
            return
        with torch.no_grad():
            for step in self.steps:
                step.replay()
