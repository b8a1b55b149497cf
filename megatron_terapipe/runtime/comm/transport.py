"""Point-to-point transport between neighbouring pipeline stages.

Messages go in one of two directions: "F" carries an activation to the next stage, "B" a
gradient to the previous one; in a V of model chunks (schedule/routes.py) chunk 1 runs the
other way, on the routes "F-up" and "B-down", which the methods take where they take a
direction (`runs_v_shape`: the transports that do). Shapes come from the plan on both sides,
so no shape handshake is needed. A transport says how it wants the schedule lowered
(`lowering`): the executor runs the lowered list's SEND / RECV / POST / fused actions through
`send`, `recv`, `post` and `send_recv`.

`TorchTransport` (any device; used on CPU with gloo) uses asynchronous `isend` and `irecv`: a
stage never waits on its own sends, so any schedule that passes `schedule.validate` runs
without deadlock. On gloo, receives are posted early (POST actions): gloo moves a message only
once its receive is posted (1.2-2 ms for 512 KiB over loopback, measured), which a stage
waiting on a blocking receive would otherwise spend idle at every cell. Megatron's own
communicator (CUDA) lives in megatron/hooks/p2p.py.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ...schedule import Lowering
from ...schedule.routes import OPPOSITE_ROUTES
from ..memory.buffer_pool import BufferPool

# Tags keep the routes apart on gloo, whose matching is per (peer, tag) in order: the two
# directions, and a V's way back (schedule/routes.py: message_route).
_TAGS = {"F": 7001, "B": 7002, "F-up": 7003, "B-down": 7004}


class HostBuffers:
    """Host buffers of a host-staged transport, per shape and dtype, reused. On a GPU they are
    page-locked (pinned): a copy between the device and pageable memory goes through the
    driver's own staging at a fraction of the speed, and the benchmarks' host-staged
    communicator, whose transfers price the simulator's link, pins its buffers too. A buffer
    given back with the event of a copy still reading it is reused only once that event is done."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.free: dict[tuple, list[tuple[Optional[object], torch.Tensor]]] = {}
        self.allocated = 0

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        free = self.free.setdefault((tuple(shape), dtype), [])
        for i, (event, buf) in enumerate(free):
            if event is None or event.query():
                del free[i]
                return buf
        self.allocated += 1
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self.pin)

    def give(self, buf: torch.Tensor, event: Optional[object] = None) -> None:
        self.free.setdefault((tuple(buf.shape), buf.dtype), []).append((event, buf))


class Transport:
    """No neighbours (a one-stage pipeline); subclasses move tensors to and from them."""

    lowering = Lowering()
    receives = 0  # messages received (counted where the transport can tell)
    receives_posted_early = 0  # of which the receive was posted before it was needed
    received_elements = 0  # elements those receives carried (counted where receives are)
    # Where receive buffers come from, when the transport allocates them (set by the executor,
    # which gives them back): at fixed addresses every iteration, as a CUDA graph needs.
    pool: Optional[BufferPool] = None
    runs_v_shape = False  # whether it carries a V's routes ("F-up", "B-down")

    def send(self, direction: str, tensor: torch.Tensor) -> None:
        raise RuntimeError("TeraPipe: no neighbour stage to send to")

    def recv(self, direction: str, shape: Sequence[int]) -> torch.Tensor:
        raise RuntimeError("TeraPipe: no neighbour stage to receive from")

    def post(self, direction: str, shape: Sequence[int]) -> None:
        """Start receiving the next message in `direction` (only where `lowering` asks)."""
        raise RuntimeError("TeraPipe: this transport does not post receives early")

    def send_recv(self, direction: str, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """Send in `direction` and receive the opposite message from the same neighbour."""
        self.send(direction, tensor)
        return self.recv(OPPOSITE_ROUTES[direction], shape)

    def peer_received(self, direction: str, count: int) -> None:
        """The neighbour has received the first `count` messages sent in `direction` (the
        executor knows it from what came back): their tensors may go. Blocking sends keep none."""

    def finish(self) -> None:
        """Wait for this stage's sends; called once the stage's list has run."""


class TorchTransport(Transport):
    """`ring`: virtual stages, where the last rank sends forward to the first (its next model
    chunk) and the first backward to the last; the tags keep the two directions apart also
    where both neighbours are one rank (two stages). It carries a V's routes too: "F-up" to
    the previous rank, "B-down" to the next, each on its own tag.

    A sent tensor is kept (a detached alias of its storage) until its send is waited on: gloo
    reads it only once the receiver has posted its receive, and a stage output freed after
    its send (deallocated pipeline outputs) would otherwise hand that memory to the next
    allocation while the send still reads it.

    `host_staged`: messages cross through host memory on gloo, received into a device buffer
    of the pool: for stages that share one GPU (CUDA MPS), where NCCL refuses two ranks on one
    device (the transport setting "host" of the Megatron glue, megatron/hooks/p2p.py)."""

    runs_v_shape = True

    def __init__(self, pp_group, dtype: torch.dtype, device: torch.device,
                 ring: bool = False, host_staged: bool = False) -> None:
        self.group = pp_group
        self.dtype = dtype
        self.device = device
        self.host_staged = host_staged
        self.host = HostBuffers(pin=host_staged and torch.device(device).type == "cuda")
        rank = dist.get_rank(pp_group)
        ranks = dist.get_process_group_ranks(pp_group)
        K = len(ranks)
        # The neighbour each direction sends to; it receives from the other one.
        following = ranks[rank + 1] if rank + 1 < K else None
        previous = ranks[rank - 1] if rank > 0 else None
        self.peer = {"F": ranks[(rank + 1) % K] if ring else following,
                     "B": ranks[(rank - 1) % K] if ring else previous,
                     "F-up": previous, "B-down": following}
        # Sends in flight per route, oldest first, and how many were sent in all.
        self._sending: dict[str, deque[tuple[dist.Work, torch.Tensor]]] = {
            route: deque() for route in _TAGS}
        self._sent = {route: 0 for route in _TAGS}
        self._posted: dict[str, tuple[dist.Work, torch.Tensor]] = {}  # route -> receive
        # Only gloo posts ahead: NCCL runs a pair's sends and receives in order on one stream,
        # where a receive posted ahead would hold back this stage's own send its peer waits for.
        self.lowering = Lowering(post_receives_early=host_staged or dist.get_backend(pp_group) == "gloo")
        self.receives = 0
        self.receives_posted_early = 0
        self.received_elements = 0

    def _source(self, direction: str) -> Optional[int]:
        return self.peer[OPPOSITE_ROUTES[direction]]

    def send(self, direction: str, tensor: torch.Tensor) -> None:
        dst = self.peer[direction]
        if dst is None:
            raise RuntimeError("TeraPipe: no neighbour stage to send to")
        tensor = tensor.detach().to(self.dtype)
        tensor = (self._to_host(tensor) if self.host_staged else tensor).contiguous()
        work = dist.isend(tensor, dst, group=self.group, tag=_TAGS[direction])
        self._sending[direction].append((work, tensor))
        self._sent[direction] += 1
        self.peer_received(direction, 0)

    def peer_received(self, direction: str, count: int) -> None:
        """Let go of the sent tensors the neighbour has: the first `count` messages, and any
        whose send reports completion (gloo reports it only once waited on). A stage output
        freed after its send (deallocated pipeline outputs) then really leaves memory."""
        queue = self._sending[direction]
        while queue and (self._sent[direction] - len(queue) < count or queue[0][0].is_completed()):
            work, sent = queue.popleft()
            work.wait()
            self._sent_back(sent)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device tensor copied into a host buffer, complete before gloo reads it."""
        if tensor.device.type != "cuda":
            return tensor.to("cpu")
        buf = self.host.take(tensor.shape, tensor.dtype)
        buf.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        return buf

    def _sent_back(self, sent: torch.Tensor) -> None:
        """A sent host buffer, the send done: free for the next message."""
        if self.host.pin and sent.is_pinned():
            self.host.give(sent)

    def _irecv(self, direction: str, shape: Sequence[int]) -> tuple[dist.Work, torch.Tensor]:
        src = self._source(direction)
        if src is None:
            raise RuntimeError("TeraPipe: no neighbour stage to receive from")
        if self.host_staged:
            buf = self.host.take(shape, self.dtype)
        elif self.pool is not None:
            buf = self.pool.take(tuple(shape), self.dtype, self.device)
        else:
            buf = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        return dist.irecv(buf, src, group=self.group, tag=_TAGS[direction]), buf

    def post(self, direction: str, shape: Sequence[int]) -> None:
        if direction in self._posted:
            raise RuntimeError(f"TeraPipe: a second receive posted in direction {direction}")
        self._posted[direction] = self._irecv(direction, shape)

    def recv(self, direction: str, shape: Sequence[int]) -> torch.Tensor:
        posted = self._posted.pop(direction, None)
        self.receives += 1
        if posted is None:
            work, buf = self._irecv(direction, shape)
        else:
            self.receives_posted_early += 1
            work, buf = posted
            if tuple(buf.shape) != tuple(shape):  # the lowering posted it for another cell
                raise RuntimeError(f"TeraPipe: a receive of shape {tuple(shape)} found the "
                                   f"posted receive of shape {tuple(buf.shape)}")
        work.wait()
        self.received_elements += buf.numel()
        if not self.host_staged:
            return buf
        out = (self.pool.take(tuple(shape), self.dtype, self.device) if self.pool is not None
               else torch.empty(tuple(shape), dtype=self.dtype, device=self.device))
        if not self.host.pin:
            out.copy_(buf)
            self.host.give(buf)
            return out
        out.copy_(buf, non_blocking=True)  # the buffer is reused once this copy has read it
        done = torch.cuda.Event()
        done.record()
        self.host.give(buf, done)
        return out

    def finish(self) -> None:
        if self._posted:
            raise RuntimeError("TeraPipe: a receive was posted that the schedule never used")
        for queue in self._sending.values():
            for work, sent in queue:
                work.wait()
                self._sent_back(sent)
            queue.clear()
