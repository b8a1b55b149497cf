"""Point-to-point transport between neighbouring pipeline stages.

Shapes come from the plan on both sides, so no shape handshake is needed.

- `MegatronTransport` (CUDA): Megatron's own P2PCommunicator. Its blocking batched calls need a
  send and the following receive fused into one call (as Megatron's 1F1B does), which the
  executor does through `send_forward_recv_backward` / `send_backward_recv_forward`.
- `TorchTransport` (any device, used on CPU/gloo): asynchronous `isend` plus `irecv`. A stage
  never waits on its own sends, so any schedule that passes `schedule.validate` runs without
  deadlock. Send buffers stay referenced until `finish()`. On gloo, the executor posts the
  receive of a stage's next input in each direction (`prefetch_forward` /
  `prefetch_backward`) before it computes the current cell, so the transfer overlaps compute:
  gloo moves a message only once its receive is posted (1.2-2 ms for 512 KiB over loopback,
  measured), which a stage waiting on a blocking receive would otherwise spend idle at every
  cell.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

# Tags keep the two directions apart on gloo, whose matching is per (peer, tag) in order.
_TAG_FORWARD = 7001
_TAG_BACKWARD = 7002


class Transport:
    def recv_forward(self, shape: Sequence[int]) -> torch.Tensor: ...
    def recv_backward(self, shape: Sequence[int]) -> torch.Tensor: ...
    def send_forward(self, tensor: torch.Tensor) -> None: ...
    def send_backward(self, tensor: torch.Tensor) -> None: ...

    def prefetch_forward(self, shape: Sequence[int]) -> None:
        """Start receiving the next forward input (a no-op where receives cannot be posted early)."""

    def prefetch_backward(self, shape: Sequence[int]) -> None:
        """Start receiving the next output gradient."""

    def send_forward_recv_backward(self, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        self.send_forward(tensor)
        return self.recv_backward(shape)

    def send_backward_recv_forward(self, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        self.send_backward(tensor)
        return self.recv_forward(shape)

    def finish(self) -> None:
        pass


class TorchTransport(Transport):
    def __init__(self, pp_group, dtype: torch.dtype, device: torch.device) -> None:
        self.group = pp_group
        self.dtype = dtype
        self.device = device
        rank = dist.get_rank(pp_group)
        size = dist.get_world_size(pp_group)
        ranks = dist.get_process_group_ranks(pp_group)
        self.prev = ranks[rank - 1] if rank > 0 else None
        self.next = ranks[rank + 1] if rank < size - 1 else None
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        # The one receive posted ahead per direction (tag): messages arrive in schedule order.
        self._posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        # Only gloo: NCCL runs a pair's sends and receives in order on one stream, where a
        # receive posted ahead would hold back this stage's own send that its peer waits for.
        self._posts_ahead = dist.get_backend(pp_group) == "gloo"
        self.receives = 0
        self.receives_posted_early = 0

    def _send(self, tensor: torch.Tensor, dst: Optional[int], tag: int) -> None:
        if dst is None:
            raise RuntimeError("TeraPipe: no neighbour stage to send to")
        tensor = tensor.detach()
        if tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
        tensor = tensor.contiguous()
        self._pending.append((dist.isend(tensor, dst, group=self.group, tag=tag), tensor))
        # Keep the list short: drop sends that have completed.
        if len(self._pending) > 8:
            self._pending = [(w, t) for (w, t) in self._pending if not w.is_completed()]

    def _post(self, shape: Sequence[int], src: Optional[int], tag: int) -> tuple[dist.Work, torch.Tensor]:
        if src is None:
            raise RuntimeError("TeraPipe: no neighbour stage to receive from")
        buf = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        return dist.irecv(buf, src, group=self.group, tag=tag), buf

    def _prefetch(self, shape: Sequence[int], src: Optional[int], tag: int) -> None:
        if self._posts_ahead and tag not in self._posted:
            self._posted[tag] = self._post(shape, src, tag)

    def _recv(self, shape: Sequence[int], src: Optional[int], tag: int) -> torch.Tensor:
        posted = self._posted.pop(tag, None)
        self.receives += 1
        if posted is None:
            work, buf = self._post(shape, src, tag)
        else:
            self.receives_posted_early += 1
            work, buf = posted
            if tuple(buf.shape) != tuple(shape):  # the executor prefetched for another cell
                raise RuntimeError(f"TeraPipe: a receive of shape {tuple(shape)} found the "
                                   f"posted receive of shape {tuple(buf.shape)}")
        work.wait()
        return buf

    def prefetch_forward(self, shape):
        self._prefetch(shape, self.prev, _TAG_FORWARD)

    def prefetch_backward(self, shape):
        self._prefetch(shape, self.next, _TAG_BACKWARD)

    def recv_forward(self, shape):
        return self._recv(shape, self.prev, _TAG_FORWARD)

    def recv_backward(self, shape):
        return self._recv(shape, self.next, _TAG_BACKWARD)

    def send_forward(self, tensor):
        self._send(tensor, self.next, _TAG_FORWARD)

    def send_backward(self, tensor):
        self._send(tensor, self.prev, _TAG_BACKWARD)

    def finish(self) -> None:
        if self._posted:
            raise RuntimeError("TeraPipe: a receive was posted that the schedule never used")
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


class MegatronTransport(Transport):
    """Megatron's P2PCommunicator with explicit per-cell shapes (CUDA/NCCL path)."""

    def __init__(self, communicator, is_first: bool, is_last: bool) -> None:
        self.p2p = communicator
        self.is_first = is_first
        self.is_last = is_last

    # Megatron reads a list of ints as one shape but iterates a list in its fused calls, so
    # shapes go in as torch.Size (single) or [torch.Size] (fused).
    def recv_forward(self, shape):
        return self.p2p.recv_forward(torch.Size(shape), self.is_first)

    def recv_backward(self, shape):
        return self.p2p.recv_backward(torch.Size(shape), self.is_last)

    def send_forward(self, tensor):
        self.p2p.send_forward(tensor, self.is_last)

    def send_backward(self, tensor):
        self.p2p.send_backward(tensor, self.is_first)

    def send_forward_recv_backward(self, tensor, shape):
        return self.p2p.send_forward_recv_backward(tensor, [torch.Size(shape)], self.is_last)

    def send_backward_recv_forward(self, tensor, shape):
        return self.p2p.send_backward_recv_forward(tensor, [torch.Size(shape)], self.is_first)


def make_transport(pp_group, config, device: torch.device, is_first: bool, is_last: bool,
                   p2p_communicator=None) -> Transport:
    """Megatron's communicator where it works (CUDA), the device-aware torch path elsewhere."""
    dtype = config.pipeline_dtype or torch.float32
    # config.terapipe_transport ("megatron" or "torch") overrides the choice, e.g. to run
    # Megatron's communicator on gloo in tests.
    choice = getattr(config, "terapipe_transport", None) or ("megatron" if device.type == "cuda" else "torch")
    if choice not in ("megatron", "torch"):
        raise ValueError(f"terapipe_transport must be 'megatron' or 'torch', got {choice!r}")
    if choice == "megatron":
        if p2p_communicator is None:
            import copy

            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            # Shapes come from the plan, so the communicator's shape handshake is never needed.
            p2p_config = copy.copy(config)
            p2p_config.variable_seq_lengths = False
            p2p_communicator = P2PCommunicator(pp_group=pp_group, config=p2p_config)
        return MegatronTransport(p2p_communicator, is_first, is_last)
    return TorchTransport(pp_group, dtype, device)
