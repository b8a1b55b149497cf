"""Capture-safety audit: would capturing every cell as a CUDA graph work, and would replays be right?

A CUDA graph records a cell's kernels once and replays them on the same addresses. What breaks
a capture, or makes a replay silently wrong, can be seen on CPU by watching every aten op a
cell dispatches (a TorchDispatchMode over one or more iterations; the executor names the
running cell or W action, context.current_action). `CaptureAudit` reports, naming the op and
the cell:

- sync: an op that reads a tensor's value on the host (`.item()`, `float(t)`, `nonzero`, ...):
  not allowed while capturing, and a replay would keep the value read at capture;
- host_to_device: a tensor with elements built from Python data (`torch.tensor` of a list),
  or a copy from host memory: on a GPU a host-to-device copy, whose value a replay keeps.
  A 0-dim tensor from a Python number (`x[mask] = 0.0` lifts one) is a kernel constant,
  like any Python number passed to an op: a graph keeps it, so values that change between
  iterations must live in device tensors;
- host_tensor: an op on a host tensor. On a GPU run, any CPU tensor with elements (0-dim CPU
  tensors are scalars the kernel takes by value, Megatron's constant fills use them); on a
  CPU run, where every tensor is a host tensor, the ones built from Python data in the
  audited iterations, and what ops outside cells made from them;
- rng: a random op drawing from a generator other than the device's default one (the one a
  graph capture registers) or those named graph-safe;
- address: a tensor a cell reads that was made outside every cell (parameters, gradients,
  pooled buffers, received messages, staged data) sits at another address than in the
  previous audited iteration: a replay would read the old one. Tensors made inside cells are
  not checked: under capture they live in the graphs' memory pool, at fixed addresses.

Audit iterations after a warm-up (lazy set-up and the buffer pool's first allocations happen
in the first one): `audit_iterations(run)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from ..context import current_action

_aten = torch.ops.aten

#: What each kind of violation breaks, for the report.
KINDS = {
    "sync": "reads a tensor's value on the host: not allowed during capture, and a replay "
            "keeps the value read at capture",
    "host_to_device": "builds a tensor from Python data (a host-to-device copy on a GPU): a "
                      "replay keeps the captured value",
    "host_tensor": "computes on a host tensor: a graph captures only device work",
    "rng": "draws random numbers from a generator the graph does not register: a replay "
           "repeats the captured numbers",
    "address": "reads a tensor made outside the cell at another address than in the previous "
               "iteration: a replay reads the old address",
}

_SYNC_OPS = {_aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten._unique2,
             _aten.unique_dim, _aten.unique_consecutive, _aten.equal, _aten.is_nonzero}
_PYTHON_DATA_OPS = {_aten.lift_fresh, _aten.lift_fresh_copy}
_RANDOM_OPS = {_aten.bernoulli, _aten.bernoulli_, _aten.native_dropout, _aten.rand,
               _aten.rand_like, _aten.randn, _aten.randn_like, _aten.randint, _aten.randint_like,
               _aten.randperm, _aten.normal, _aten.normal_, _aten.uniform_, _aten.exponential_,
               _aten.multinomial, _aten.geometric_, _aten.cauchy_, _aten.log_normal_,
               _aten.random_}


@dataclass(frozen=True)
class Violation:
    kind: str  # a key of KINDS
    op: str  # the aten op, e.g. "aten._local_scalar_dense.default"
    cell: str  # the running action, e.g. "F(m0b0t1)"
    detail: str = ""

    def __str__(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.kind}: {self.op} in cell {self.cell}{extra}: {KINDS[self.kind]}"


class CaptureSafetyError(RuntimeError):
    """A cell does something a CUDA graph capture cannot hold; `violations` lists them."""

    def __init__(self, violations: list[Violation]) -> None:
        lines = "\n".join(f"  {v}" for v in violations[:20])
        more = f"\n  ... and {len(violations) - 20} more" if len(violations) > 20 else ""
        super().__init__(f"TeraPipe: {len(violations)} capture-safety violation(s):\n{lines}{more}")
        self.violations = violations


@dataclass
class AuditReport:
    violations: list[Violation]
    ops_in_cells: int  # aten ops dispatched inside cells and W actions, all audited iterations
    cells: set[str] = field(default_factory=set)  # labels of the actions seen

    def kinds(self) -> set[str]:
        return {v.kind for v in self.violations}

    def check(self) -> None:
        if self.violations:
            raise CaptureSafetyError(self.violations)


# An argument a cell read: where it sits now. Keyed by (cell, op position in the cell, argument).
_Reads = dict[tuple[str, int, int], tuple[str, int]]


class CaptureAudit(TorchDispatchMode):
    """Watch iterations for what a CUDA graph capture of their cells cannot hold.

    device: the stage's compute device (None: the CPU rules). graph_safe_generators: random
    generators the graphs would register besides the devices' default ones. Call
    `next_iteration()` between iterations (address checks compare consecutive ones).
    """

    def __init__(self, device: Optional[torch.device] = None,
                 graph_safe_generators: Iterable[torch.Generator] = ()) -> None:
        super().__init__()
        self.device = torch.device(device) if device is not None else None
        self.safe_generators = list(graph_safe_generators)
        self.found: dict[tuple[str, str, str], Violation] = {}  # first of each kind, op, cell
        self.iterations: list[_Reads] = [{}]
        self.positions: dict[str, int] = {}  # ops so far per cell in this iteration
        self.cell_made = WeakTensorKeyDictionary()  # tensors made inside cells
        self.host_made = WeakTensorKeyDictionary()  # tensors built from Python data
        self.ops_in_cells = 0
        self.cells: set[str] = set()

    def next_iteration(self) -> None:
        self.iterations.append({})
        self.positions = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cell = current_action()
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if cell is not None:
            self._check_op(func, cell, inputs, args, kwargs)
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        made_from_host = ((func.overloadpacket in _PYTHON_DATA_OPS and _has_elements(outputs))
                          or (cell is None and any(t in self.host_made for t in inputs)))
        for t in outputs:
            if cell is not None:
                self.cell_made[t] = True
            if made_from_host:
                self.host_made[t] = True
        return out

    def _check_op(self, func, cell: str, inputs: list[torch.Tensor], args, kwargs) -> None:
        self.ops_in_cells += 1
        self.cells.add(cell)
        packet = func.overloadpacket
        if packet in _SYNC_OPS or (packet is _aten.repeat_interleave
                                   and func is _aten.repeat_interleave.Tensor
                                   and kwargs.get("output_size") is None):
            self._add("sync", func, cell)
        if packet in _PYTHON_DATA_OPS:
            if _has_elements(inputs):
                self._add("host_to_device", func, cell, "a tensor built from Python data")
            return  # its argument is the fresh host tensor Python built: nothing else to check
        elif packet in (_aten._to_copy, _aten.copy_) and self._host_to_device(func, args, kwargs):
            self._add("host_to_device", func, cell, "a copy from host memory")
        host = [i for i, t in enumerate(inputs) if self._is_host(t)]
        if host:
            self._add("host_tensor", func, cell, f"argument {host[0]}")
        if packet in _RANDOM_OPS:
            self._check_generator(func, cell, args, kwargs)
        self._record_reads(func, cell, inputs)

    def _host_to_device(self, func, args, kwargs) -> bool:
        if func.overloadpacket is _aten.copy_:
            dst, src = args[0], args[1]
            return src.device.type == "cpu" and dst.device.type != "cpu"
        target = kwargs.get("device")
        return args[0].device.type == "cpu" and target is not None and torch.device(target).type != "cpu"

    def _is_host(self, t: torch.Tensor) -> bool:
        if t in self.host_made:
            return True
        on_gpu_run = self.device is not None and self.device.type != "cpu"
        return on_gpu_run and t.device.type == "cpu" and t.dim() > 0

    def _check_generator(self, func, cell: str, args, kwargs) -> None:
        generators = [g for g in tree_flatten((args, kwargs))[0] if isinstance(g, torch.Generator)]
        foreign = [g for g in generators if not any(g is s for s in self.safe_generators)]
        if foreign:
            self._add("rng", func, cell, f"a {foreign[0].device} generator passed explicitly")
            return
        on_gpu_run = self.device is not None and self.device.type != "cpu"
        if on_gpu_run and _output_device(func, args, kwargs) == "cpu":
            self._add("rng", func, cell, "the CPU generator")

    def _record_reads(self, func, cell: str, inputs: list[torch.Tensor]) -> None:
        position = self.positions.get(cell, 0)
        self.positions[cell] = position + 1
        reads = self.iterations[-1]
        for index, t in enumerate(inputs):
            if t in self.cell_made or (t._base is not None and t._base in self.cell_made):
                continue
            try:
                address = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage (e.g. a wrapper subclass)
                continue
            reads[(cell, position, index)] = (str(func), address)

    def _add(self, kind: str, func, cell: str, detail: str = "") -> None:
        key = (kind, str(func), cell)
        if key not in self.found:
            self.found[key] = Violation(kind, str(func), cell, detail)

    def address_changes(self) -> list[Violation]:
        """Arguments made outside their cell that moved between consecutive audited iterations."""
        moved: dict[tuple[str, str], Violation] = {}
        for before, after in zip(self.iterations, self.iterations[1:]):
            for key, (op, address) in after.items():
                old = before.get(key)
                if old is None or old[0] != op or old[1] == address:
                    continue
                cell, position, index = key
                moved.setdefault((op, cell), Violation(
                    "address", op, cell, f"op {position} of the cell, argument {index}: "
                    f"{old[1]:#x} then {address:#x}"))
        return list(moved.values())

    def report(self) -> AuditReport:
        return AuditReport(list(self.found.values()) + self.address_changes(), self.ops_in_cells,
                           set(self.cells))


def _has_elements(tensors: list[torch.Tensor]) -> bool:
    return any(t.dim() > 0 for t in tensors)


def _output_device(func, args, kwargs) -> str:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device).type
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first.device.type if first is not None else "cpu"


def audit_iterations(run: Callable[[], Any], iterations: int = 2, warmup: int = 1,
                     device: Optional[torch.device] = None,
                     graph_safe_generators: Iterable[torch.Generator] = ()) -> AuditReport:
    """Run `run()` (one training iteration) `warmup` times unwatched, then `iterations` times
    under one CaptureAudit; returns its report (`.check()` raises on any violation)."""
    if iterations < 2:
        raise ValueError("audit_iterations: address checks need at least 2 audited iterations")
    for _ in range(warmup):
        run()
    audit = CaptureAudit(device, graph_safe_generators)
    for i in range(iterations):
        if i:
            audit.next_iteration()
        with audit:
            run()
    return audit.report()
