"""A capture-safety audit: what, inside a compute action, would break or invalidate a CUDA graph
capture of that action, found on any device (the CPU included) by watching the ops dispatched.

A plan fixes every cell's shape, so each distinct cell could be captured once and replayed. A
replay re-runs the captured kernels on the captured addresses, so inside an action it must not:

- sync: read a tensor's value on the host (`.item()`, `bool(t)`, ops whose output size depends
  on the data): capture fails;
- copy from the host: a tensor built from Python values (`torch.tensor(...)`), or a copy from a
  CPU tensor to the device: not captured, the replay reuses the first value;
- use a CPU tensor in a device op (device runs only): the value is read at capture;
- read a tensor made outside every action (a receive buffer, a K/V buffer, a batch) whose
  address changes between iterations: the replay reads the old address;
- draw random numbers from a generator that is not graph-safe (on a CPU run: any generator
  not registered with `graph_safe_generators`).

Code that a cell's graphs would leave out and run eagerly is marked with
`context.eager_region()` and not audited (e.g. Megatron's loss: its vocab-parallel cross
entropy writes `masked_target[target_mask] = 0`, a tensor from a Python value and, on a GPU, a
boolean-mask index that syncs; Megatron's own per-layer graphs leave the loss out too).

Each finding names its kind, the op and the action (runtime/context.py's label, e.g.
"F m0 b0 t1"). Run two iterations under one audit (`audit.next_iteration()` between them):
addresses are compared from the second on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .context import current_action, in_eager_region

_aten = torch.ops.aten
SYNC_OPS = {_aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten.equal,
            _aten.is_nonzero, _aten._unique2, _aten.unique_consecutive}
FROM_PYTHON_OPS = {_aten.lift_fresh, _aten.lift_fresh_copy, _aten.scalar_tensor}
COPY_OPS = {_aten.copy_, _aten._to_copy}
RNG_OPS = {_aten.bernoulli, _aten.bernoulli_, _aten.rand, _aten.rand_like, _aten.randn,
           _aten.randn_like, _aten.randint, _aten.randint_like, _aten.randperm, _aten.normal,
           _aten.normal_, _aten.uniform_, _aten.multinomial, _aten.exponential_}
DROPOUT_OPS = {_aten.native_dropout, _aten.dropout}


@dataclass(frozen=True)
class Violation:
    kind: str  # "sync", "copy from the host", "CPU tensor", "address changes", "RNG"
    op: str
    action: str

    def __str__(self) -> str:
        return f"{self.action}: {self.kind} ({self.op})"


class CaptureAuditError(RuntimeError):
    """What the audit found, one line each."""


@dataclass
class _Iteration:
    made: set[int] = field(default_factory=set)  # storages allocated inside actions
    reads: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # action -> (op, ptr)


class CaptureAudit(TorchDispatchMode):
    """Watch the ops of whole iterations and report what inside an action a CUDA graph capture
    could not take (see the module docstring). `device`: the device the model runs on (a CPU
    tensor used by a device op is reported when it is not the CPU)."""

    def __init__(self, device: torch.device,
                 graph_safe_generators: Iterable[torch.Generator] = ()) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.graph_safe = list(graph_safe_generators)
        self.violations: list[Violation] = []
        self._iterations: list[_Iteration] = [_Iteration()]

    def next_iteration(self) -> None:
        """Start the next iteration: its reads are compared with the previous one's."""
        self._compare_addresses()
        self._iterations.append(_Iteration())

    def check(self) -> None:
        """Raise CaptureAuditError listing every finding (addresses compared up to now)."""
        self._compare_addresses()
        if self.violations:
            unique = list(dict.fromkeys(str(v) for v in self.violations))
            raise CaptureAuditError(
                f"{len(unique)} thing(s) inside compute actions would break or invalidate a "
                f"CUDA graph capture:\n  " + "\n  ".join(unique))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        action = current_action()
        out = func(*args, **kwargs)
        if action is not None:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if not in_eager_region():  # what runs eagerly only makes tensors for the graphs
                self._inspect(func, action, tensors, args, kwargs)
            read = {_storage(t) for t in tensors}  # a view or an in-place result is not new
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and _storage(t) not in read:
                    self._iterations[-1].made.add(_storage(t))
        return out

    @property
    def actions_seen(self) -> int:
        """How many compute actions the current iteration ran ops in."""
        return len(self._iterations[-1].reads)

    def _inspect(self, func, action: str, tensors: list[torch.Tensor], args, kwargs) -> None:
        packet, name = func.overloadpacket, str(func)
        if packet in SYNC_OPS:
            self._report("sync", name, action)
        if packet in FROM_PYTHON_OPS:
            self._report("copy from the host", name, action)
        elif packet in COPY_OPS and self._host_to_device(packet, args, kwargs):
            self._report("copy from the host", name, action)
        if self.device.type != "cpu" and any(t.device.type == "cpu" for t in tensors):
            self._report("CPU tensor", name, action)
        if self._draws_random(packet, args, kwargs):
            self._report("RNG", name, action)
        reads = self._iterations[-1].reads.setdefault(action, [])
        made = self._iterations[-1].made
        reads.extend((name, _storage(t)) for t in tensors if _storage(t) not in made)

    def _host_to_device(self, packet, args, kwargs) -> bool:
        if packet is _aten.copy_:
            return args[1].device.type == "cpu" and args[0].device.type != "cpu"
        target = kwargs.get("device")
        return args[0].device.type == "cpu" and target is not None and \
            torch.device(target).type != "cpu"

    def _draws_random(self, packet, args, kwargs) -> bool:
        if packet in DROPOUT_OPS:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.0)
            train = args[2] if len(args) > 2 else kwargs.get("train", True)
            return bool(train) and p not in (0, 0.0, None)
        if packet not in RNG_OPS:
            return False
        generator: Optional[torch.Generator] = next(
            (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Generator)), None)
        # dispatch hands over another Python object for the same generator: compare states
        return generator is None or not any(
            g.device == generator.device and torch.equal(g.get_state(), generator.get_state())
            for g in self.graph_safe)

    def _report(self, kind: str, op: str, action: str) -> None:
        self.violations.append(Violation(kind, op, action))

    def _compare_addresses(self) -> None:
        if len(self._iterations) < 2:
            return
        before, now = self._iterations[-2].reads, self._iterations[-1].reads
        for action, reads in now.items():
            old = before.get(action)
            if old is None or len(old) != len(reads):
                continue  # another order of actions: nothing to compare it with
            for (op, ptr), (_, was) in zip(reads, old):
                if ptr != was:
                    self._report("address changes", op, action)
                    break


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse, ...)
        return id(t)
