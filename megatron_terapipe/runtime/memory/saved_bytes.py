"""Counting the activation bytes autograd keeps alive, on any device.

`SavedTensorMeter` hooks autograd's saved tensors: a tensor counts from the moment a node saves
it until the node is freed (after its backward, or when the graph is dropped). Storages are
counted once however many nodes share them, and parameters are not activations.
"""

from __future__ import annotations

import torch


class _Saved:
    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "SavedTensorMeter") -> None:
        self.tensor = tensor
        self.key = key
        self.meter = meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """with SavedTensorMeter() as meter: ...; meter.peak_bytes, meter.live_bytes."""

    def __init__(self, exclude: tuple[torch.Tensor, ...] = ()) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._hooks = None

    def _pack(self, x: torch.Tensor):
        if isinstance(x, torch.nn.Parameter) or x.device.type == "meta":
            return x
        storage = x.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or key == 0:
            return x
        count = self._refs.get(key, 0)
        if count == 0:
            size = storage.nbytes()
            self._sizes[key] = size
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = count + 1
        return _Saved(x, key, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        count = self._refs.get(key, 0) - 1
        if count <= 0:
            self._refs.pop(key, None)
            self.live_bytes -= self._sizes.pop(key, 0)
        else:
            self._refs[key] = count

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
