"""Tensors at fixed addresses for a fixed plan: a pool reused across microbatches and iterations.

A CUDA graph replays kernels on the addresses it captured, so every buffer a cell reads or
writes across its boundary must sit at the same address each time the cell runs. The runtime's
own cross-cell buffers (the slice attention's K/V buffers and their gradient buffers,
attention/kv_cache.py) come from a `BufferPool` kept per plan (megatron/hooks/forward_backward.py keeps one per
model, plan and batch shape). After the first iteration the pool allocates nothing: each
request takes an existing tensor.

Which tensor a request gets is the free tensor of that shape with the lowest slot number, a
function of the *set* of free slots, not of the order they were given back in. A plan runs the
same takes and returns in the same order every iteration and starts with every slot free, so
every request gets the same slot, hence the same address, every iteration (a last-in-first-out
free list would not: two sequences alive together swap buffers from one iteration to the next).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

PoolKey = tuple  # (shape, dtype, device)


@dataclass(frozen=True)
class PoolTake:
    """One request the pool served: what it was for, which slot, at which address."""

    label: str  # the running action (context.current_action), e.g. "F(m0b0t1)"
    key: PoolKey
    slot: int
    data_ptr: int


@dataclass
class BufferPool:
    """Tensors by (shape, dtype, device), handed out lowest free slot first.

    allocations: tensors created so far (the first iteration's; none in the steady state).
    log: every take of the iteration being recorded (`record()`), for the capture audit.
    label_of: names the running action for the log (set by the executor).
    chunks_reading_data: per model chunk of the stage, whether forward_step read its data
    iterator, learned in the first iteration (None before): later iterations read and stage
    each microbatch before its first cell, outside it (runtime/batching.py).
    """

    slots: dict[PoolKey, list[torch.Tensor]] = field(default_factory=dict)
    free: dict[PoolKey, list[int]] = field(default_factory=dict)  # heaps of slot numbers
    owner: dict[int, tuple[PoolKey, int]] = field(default_factory=dict)  # id(tensor) -> slot
    allocations: int = 0
    log: Optional[list[PoolTake]] = None
    label_of: Callable[[], str] = lambda: "outside a cell"
    chunks_reading_data: Optional[tuple[bool, ...]] = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             zeroed: bool = False) -> torch.Tensor:
        """A tensor of this shape at the same address as in the last iteration; zeroed if asked
        (the values of an uncleared one are the last user's)."""
        key = (tuple(shape), dtype, torch.device(device))
        free = self.free.setdefault(key, [])
        if free:
            slot = heapq.heappop(free)
            tensor = self.slots[key][slot]
            if zeroed:
                tensor.zero_()
        else:
            tensor = (torch.zeros if zeroed else torch.empty)(key[0], dtype=dtype, device=device)
            made = self.slots.setdefault(key, [])
            slot = len(made)
            made.append(tensor)
            self.owner[id(tensor)] = (key, slot)
            self.allocations += 1
        if self.log is not None:
            self.log.append(PoolTake(self.label_of(), key, slot, tensor.data_ptr()))
        return tensor

    def give_back(self, tensor: Optional[torch.Tensor]) -> None:
        """Return a tensor `take` handed out (None and foreign tensors are ignored)."""
        if tensor is None or id(tensor) not in self.owner:
            return
        key, slot = self.owner[id(tensor)]
        if tensor.requires_grad:  # a received input: its next user must not see this gradient
            tensor.grad = None
            tensor.requires_grad_(False)
        heapq.heappush(self.free[key], slot)

    def slot_of(self, tensor: torch.Tensor) -> Optional[int]:
        entry = self.owner.get(id(tensor))
        return None if entry is None else entry[1]

    def record(self) -> list[PoolTake]:
        """Start a fresh log of takes; returns it (filled as the iteration runs)."""
        self.log = []
        return self.log
