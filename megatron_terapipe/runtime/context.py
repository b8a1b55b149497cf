"""The cell the executor is running now, for the layers that act per cell.

Slice attention reads the cell's K/V cache, the RoPE hook its token offset, and the deferring
linear layers its weight-gradient store. They sit deep inside the model, where the executor
cannot pass arguments, so the executor announces the cell here (`running_cell`) and they look
it up (`active_cell`). `running_action` names every compute action (F, B and W, which runs
outside a cell) for the tools that attribute work to it: the capture audit (graphs/graph_audit.py)
and the buffer pool's log.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from ..schedule import Action, Cell, format_action
from .attention.kv_cache import KVCache
from .wgrad.store import WeightGradStore


@dataclass
class ActiveCell:
    cell: Cell
    cache: KVCache
    phase: str  # "forward" or "backward" (recomputation during backward replays the prefix)
    keep_grad: bool  # False in forward_only runs: cache plain tensors
    wgrad: Optional[WeightGradStore] = None  # where linear layers defer weight gradients
    # Additive causal masks by (queries, keys, dtype, device): every layer of the cell reuses one.
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)


_ACTIVE: Optional[ActiveCell] = None


@contextlib.contextmanager
def running_cell(cell: Cell, cache: KVCache, phase: str, keep_grad: bool = True,
                 wgrad: Optional[WeightGradStore] = None) -> Iterator[None]:
    """Tell slice-aware modules which cell runs now."""
    global _ACTIVE
    previous = _ACTIVE
    _ACTIVE = ActiveCell(cell, cache, phase, keep_grad, wgrad)
    try:
        yield
    finally:
        _ACTIVE = previous


def active_cell() -> Optional[ActiveCell]:
    return _ACTIVE


_ACTION: Optional[str] = None


@contextlib.contextmanager
def running_action(kind: str, cell: Cell) -> Iterator[None]:
    """Name the compute action that runs now, e.g. "F(m0b0t1)" (microbatch, batch slice, token
    slice; the one action spelling, schedule/actions.py)."""
    global _ACTION
    previous = _ACTION
    _ACTION = format_action(Action(kind, cell))
    try:
        yield
    finally:
        _ACTION = previous


def current_action() -> Optional[str]:
    """The running compute action's label, or None between actions."""
    return _ACTION


def current_action_or_outside() -> str:
    return _ACTION or "outside a cell"
