"""K/V of earlier token slices, kept per sequence and layer for the slices after them.

Each (sequence, layer) has one buffer: a slice writes its keys and values at its token offset
and attends over the buffer's prefix (a view), so autograd keeps one copy however many later
slices read it. Its gradient buffers collect what later slices send back to earlier ones.
All four come from the executor's BufferPool (memory/buffer_pool.py), so for a fixed plan they sit at
the same addresses every iteration, as a CUDA graph replaying a cell needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ...schedule import Cell
from ..memory.buffer_pool import BufferPool


class KVBuffer:
    """Keys and values of one sequence for one layer, slice after slice, in one buffer.

    Slices write their K/V at their token offsets; a slice's attention reads the buffer's prefix
    as a view, so nothing is concatenated and autograd keeps one copy however many slices read
    it. Writes go through `.data` so they do not bump the version counter of views that earlier
    slices saved for backward (they never overlap those views). `grad_key`/`grad_value`
    collect the K/V gradients that later slices send to earlier ones. All four are taken from
    `pool` and given back by `release`.
    """

    def __init__(self, like: torch.Tensor, capacity: int, pool: BufferPool) -> None:
        shape = (capacity,) + tuple(like.shape[1:])
        self.pool = pool
        self.key = pool.take(shape, like.dtype, like.device)
        self.value = pool.take(shape, like.dtype, like.device)
        self.grad_key: Optional[torch.Tensor] = None
        self.grad_value: Optional[torch.Tensor] = None
        self.starts: list[int] = []  # token offset of every slice written
        self.filled = 0  # tokens written so far

    def __len__(self) -> int:
        return len(self.starts)

    def reserve(self, end: int) -> None:
        """Grow to hold `end` tokens (only when the sequence length was not known upfront)."""
        capacity = self.key.size(0)
        if end <= capacity:
            return
        new = max(end, 2 * capacity)
        for name in ("key", "value", "grad_key", "grad_value"):
            old = getattr(self, name)
            if old is None:
                continue
            grown = (torch.zeros if name.startswith("grad") else torch.empty)(
                (new,) + tuple(old.shape[1:]), dtype=old.dtype, device=old.device)
            grown[:capacity].copy_(old)
            setattr(self, name, grown)

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        end = start + key.size(0)
        self.reserve(end)
        self.key.data[start:end].copy_(key.detach())
        self.value.data[start:end].copy_(value.detach())
        if end > self.filled:  # a new slice (a recompute replay rewrites an old one)
            self.starts.append(start)
            self.filled = end

    def grad(self, which: str, like: torch.Tensor) -> torch.Tensor:
        name = "grad_" + which
        g = getattr(self, name)
        if g is None:
            g = self.pool.take((self.key.size(0),) + tuple(like.shape[1:]), like.dtype,
                               like.device, zeroed=True)
            setattr(self, name, g)
        return g

    def release(self) -> None:
        """Give the buffers back to the pool: the sequence is done with them."""
        for name in ("key", "value", "grad_key", "grad_value"):
            self.pool.give_back(getattr(self, name))
        self.grad_key = self.grad_value = None

    def nbytes(self) -> int:
        tensors = [t for t in (self.key, self.value, self.grad_key, self.grad_value) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class KVCache:
    """K/V buffers of every live sequence (microbatch, batch slice), per attention layer.

    seq_length: tokens per sequence when known (buffers are sized once); otherwise they grow.
    pool: where the buffers come from (pass one kept across iterations for fixed addresses).
    """

    seq_length: Optional[int] = None
    pool: BufferPool = field(default_factory=BufferPool)
    entries: dict[tuple[int, int], dict[int, KVBuffer]] = field(default_factory=dict)

    def buffer(self, cell: Cell, layer: int, like: torch.Tensor) -> KVBuffer:
        layers = self.entries.setdefault(cell.sequence_key, {})
        buf = layers.get(layer)
        if buf is None:
            capacity = self.seq_length or cell.token_end
            buf = layers[layer] = KVBuffer(like, max(capacity, cell.token_end), self.pool)
        return buf

    def release_slice(self, cell: Cell) -> None:
        """After a slice's backward; the buffers go with the sequence's first slice."""
        if cell.token_slice == 0:
            self.release_sequence(cell)

    def release_sequence(self, cell: Cell) -> None:
        for buf in self.entries.pop(cell.sequence_key, {}).values():
            buf.release()

    def live_bytes(self) -> int:
        return sum(buf.nbytes() for layers in self.entries.values() for buf in layers.values())

    def __len__(self) -> int:
        return len(self.entries)
