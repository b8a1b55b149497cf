"""The cell the executor is running now: the runtime's one implicit channel.

Some layers act per cell but sit deep inside Megatron's model, where the executor cannot pass
them an argument. So the executor announces the cell here and they look it up; nothing else in
the package passes state this way.

Who writes (`running_cell`, a context manager; `running_action` names every compute action,
F, B and W, the last of which runs outside a cell):
- runtime/executor.py, around each forward and backward cell and each action;
- megatron/measure/layers.py and memory.py, around the cells they time or measure.
Who reads (`active_cell`, None outside a cell; `current_action`):
- runtime/attention/slice_attention.py: the cell's K/V cache, its token offset (also for the
  RoPE offset hook) and its phase;
- runtime/wgrad/deferral.py: the cell's weight-gradient store;
- megatron/hooks/lm_cells.py: the cell's rows and tokens, to cut Megatron-LM's batch;
- megatron/model/moe_router_losses.py: the cell, to sum router losses per microbatch;
- runtime/graphs/graph_audit.py and the buffer pool's log: which action did the work.
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
