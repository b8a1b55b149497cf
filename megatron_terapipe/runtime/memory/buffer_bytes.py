"""Counting, besides autograd's saved tensors, the buffers the runtime keeps itself: the K/V
buffers of the slice attention and their gradients (attention/kv_cache.py) and the pieces deferred
weight gradients wait with (wgrad/store.py). Together they are what a stage holds for
backward, as the planner's memory model (planner/cost/stage_memory.py) predicts it.

    with RuntimeMemoryMeter(exclude=params) as meter, meter.counting_runtime_buffers():
        ... run the stage ...
    meter.peak_bytes
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..attention.kv_cache import KVBuffer
from .saved_bytes import SavedTensorMeter
from ..wgrad.store import WeightGradStore


class RuntimeMemoryMeter(SavedTensorMeter):
    """A SavedTensorMeter that can also hold tensors the runtime keeps (storages counted once,
    whoever keeps them)."""

    def hold(self, tensor: torch.Tensor) -> int:
        """Count `tensor`'s storage until `release(key)`; returns the key."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        count = self._refs.get(key, 0)
        if count == 0:
            self._sizes[key] = storage.nbytes()
            self.live_bytes += self._sizes[key]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = count + 1
        return key

    def release(self, key: int) -> None:
        self._release(key)

    @contextlib.contextmanager
    def counting_runtime_buffers(self) -> Iterator["RuntimeMemoryMeter"]:
        """While active (in this process), K/V buffers and their gradients count from their
        allocation until they are freed (the K/V even where no autograd node saved them, as in
        the no-grad forward of a recomputed layer), and deferred weight-gradient pieces from
        the backward that leaves them until their sequence's W action."""
        original_init = KVBuffer.__init__
        original_grad, original_add = KVBuffer.grad, WeightGradStore.add
        original_flush, original_release = WeightGradStore.flush, KVBuffer.release
        held: dict[tuple[int, int], list[int]] = {}
        held_kv: dict[int, list[int]] = {}  # id(KVBuffer) -> keys of its K/V and their gradients
        meter = self

        def init(buf: KVBuffer, *args, **kwargs) -> None:
            original_init(buf, *args, **kwargs)
            held_kv.setdefault(id(buf), []).extend(meter.hold(t) for t in (buf.key, buf.value))

        def grad(buf: KVBuffer, which: str, like: torch.Tensor) -> torch.Tensor:
            fresh = getattr(buf, "grad_" + which) is None
            tensor = original_grad(buf, which, like)
            if fresh:
                held_kv.setdefault(id(buf), []).append(meter.hold(tensor))
            return tensor

        def release(buf: KVBuffer) -> None:
            # pooled: the tensor outlives its sequence, so it counts until given back
            original_release(buf)
            for key in held_kv.pop(id(buf), []):
                meter.release(key)

        def add(store: WeightGradStore, sequence_key, weight, piece) -> None:
            keys = held.setdefault(sequence_key, [])
            keys += [meter.hold(t) for t in _piece_tensors(piece)]
            original_add(store, sequence_key, weight, piece)

        def flush(store: WeightGradStore, sequence_key) -> None:
            original_flush(store, sequence_key)
            for key in held.pop(sequence_key, []):
                meter.release(key)

        KVBuffer.grad, WeightGradStore.add, WeightGradStore.flush = grad, add, flush
        KVBuffer.__init__, KVBuffer.release = init, release
        try:
            yield self
        finally:
            KVBuffer.__init__ = original_init
            KVBuffer.grad, WeightGradStore.add = original_grad, original_add
            WeightGradStore.flush, KVBuffer.release = original_flush, original_release


def _piece_tensors(piece: object) -> list[torch.Tensor]:
    """The tensors a deferred piece keeps (its input, output gradient, statistics ...), not the
    parameters it refers to."""
    return [v for v in vars(piece).values()
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]
