"""Scatter-gather messages between stages: each TP rank sends 1/TP of a message, and the
receiving stage's TP ranks all-gather it.

Without sequence parallelism every TP rank of a stage holds the same activation (and the
same gradient of its input: Megatron all-reduces it), and Megatron's communicator sends the
whole of it from each of them: TP times the bytes across the pipeline link. Megatron-LM once
sent 1/TP per rank and all-gathered inside the node (`--no-scatter-gather-tensors-in-pipeline`
still parses; megatron-core no longer reads it). Where the pipeline link crosses nodes and
the TP group lies inside one, that divides the inter-node bytes by TP for one all-gather over
NVLink (`--terapipe-scatter-gather-p2p`). The gather runs where the cell takes its input (the
RECV action), so the planner prices it as the receiving stage's time
(`LayerStackCostModel.receive_time`), the part's transfer as the link's. The gathered tensor
is the sent one, bit for bit: the parts are slices of identical tensors.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..memory.buffer_pool import BufferPool
from .transport import Transport

# all_gather_single replaced all_gather_into_tensor in recent torch; both gather a flat part
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ScatterGatherTransport(Transport):
    """`inner` carries this TP rank's part of each message; the TP ranks of `tp_group` (all
    running the same lowered list, so their gathers match in order) put the parts together."""

    def __init__(self, inner: Transport, tp_group) -> None:
        self.inner = inner
        self.group = tp_group
        self.size, self.rank = tp_group.size(), tp_group.rank()
        self.lowering = inner.lowering
        self.received_elements = 0  # of the parts, over the pipeline link (any inner transport)

    @property
    def pool(self) -> Optional[BufferPool]:  # type: ignore[override]
        return self.inner.pool

    @pool.setter
    def pool(self, pool: Optional[BufferPool]) -> None:
        self.inner.pool = pool

    @property
    def runs_v_shape(self) -> bool:  # type: ignore[override]
        return self.inner.runs_v_shape  # routes pass through to it

    @property
    def receives(self) -> int:  # type: ignore[override]
        return self.inner.receives

    @property
    def receives_posted_early(self) -> int:  # type: ignore[override]
        return self.inner.receives_posted_early

    def _part_shape(self, shape: Sequence[int]) -> tuple[int]:
        numel = 1
        for n in shape:
            numel *= int(n)
        if numel % self.size:
            raise ValueError(f"TeraPipe: --terapipe-scatter-gather-p2p splits each message over "
                             f"the {self.size} TP ranks, but a message of shape {tuple(shape)} "
                             f"has {numel} elements")
        return (numel // self.size,)

    def _part(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous 1/TP of `tensor` (a view: the sent storage stays alive while
        the inner transport keeps the part)."""
        (n,) = self._part_shape(tensor.shape)
        return tensor.detach().contiguous().view(-1).narrow(0, self.rank * n, n)

    def _gather(self, part: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        pool = self.pool
        out = (pool.take(tuple(shape), part.dtype, part.device) if pool is not None
               else torch.empty(tuple(shape), dtype=part.dtype, device=part.device))
        _ALL_GATHER(out.view(-1), part.detach(), group=self.group)
        self.received_elements += part.numel()
        if pool is not None:
            pool.give_back(part)
        return out

    def send(self, direction: str, tensor: torch.Tensor) -> None:
        self.inner.send(direction, self._part(tensor))

    def post(self, direction: str, shape: Sequence[int]) -> None:
        self.inner.post(direction, self._part_shape(shape))

    def recv(self, direction: str, shape: Sequence[int]) -> torch.Tensor:
        return self._gather(self.inner.recv(direction, self._part_shape(shape)), shape)

    def send_recv(self, direction: str, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        part = self.inner.send_recv(direction, self._part(tensor), self._part_shape(shape))
        return self._gather(part, shape)

    def peer_received(self, direction: str, count: int) -> None:
        self.inner.peer_received(direction, count)

    def finish(self) -> None:
        self.inner.finish()
