"""The cell the executor is running now, for the layers that act per cell.

Slice attention reads the cell's K/V cache, the RoPE hook its token offset, and the deferring
linear layers its weight-gradient store. They sit deep inside the model, where the executor
cannot pass arguments, so the executor announces the cell here (`running_cell`) and they look
it up (`active_cell`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from ..schedule import Cell
from .kv_cache import KVCache
from .wgrad import WeightGradStore


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
