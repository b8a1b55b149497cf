"""Stage-to-stage transport through Megatron's P2PCommunicator (the CUDA/NCCL path), and the
choice between it and the torch transport."""

from __future__ import annotations

import copy
from collections import deque
from typing import Sequence

import torch

from ...runtime.comm.scatter_gather import ScatterGatherTransport
from ...runtime.comm.transport import TorchTransport, Transport
from ...schedule import Lowering, LoweredSchedule
from ...schedule.actions import peer_cell
from ..platform import compat


class MegatronTransport(Transport):
    """Megatron's P2PCommunicator with explicit per-cell shapes.

    Its blocking batched calls need a send and the receive right after it in one call, as
    Megatron's 1F1B does: the schedule is lowered with fused send-receive actions.

    `ring` (virtual stages): messages go round the ring of ranks, and sends do not block, as
    in Megatron's interleaved schedule with overlap_p2p_comm: each send's handle (with an
    alias of the sent storage, which a deallocated output gives up) is kept until the
    neighbour has the message; receives block where their data is used. That is what the
    schedule's validation replays, so every validated schedule runs without deadlock."""

    lowering = Lowering(fuse_send_recv=True)

    def __init__(self, communicator, is_first: bool, is_last: bool, ring: bool = False) -> None:
        self.p2p = communicator
        self.is_first = is_first and not ring
        self.is_last = is_last and not ring
        self.ring = ring
        if ring:
            self.lowering = Lowering()
        self._sending: dict[str, deque] = {"F": deque(), "B": deque()}
        self._sent = {"F": 0, "B": 0}

    # Megatron reads a list of ints as one shape but iterates a list in its fused calls, so
    # shapes go in as torch.Size (single) or [torch.Size] (fused).
    def send(self, direction: str, tensor: torch.Tensor) -> None:
        if self.ring:
            self._send_without_waiting(direction, tensor)
        elif direction == "F":
            self.p2p.send_forward(tensor, self.is_last)
        else:
            self.p2p.send_backward(tensor, self.is_first)

    def _send_without_waiting(self, direction: str, tensor: torch.Tensor) -> None:
        send = (self.p2p.send_forward_recv_forward if direction == "F"
                else self.p2p.send_backward_recv_backward)
        _, handles = send(tensor, False, None, overlap_p2p_comm=True)
        self._sending[direction].append((list(handles.values()), tensor.detach()))
        self._sent[direction] += 1

    def recv(self, direction: str, shape: Sequence[int]) -> torch.Tensor:
        if direction == "F":
            return self.p2p.recv_forward(torch.Size(shape), self.is_first)
        return self.p2p.recv_backward(torch.Size(shape), self.is_last)

    def send_recv(self, direction: str, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        if direction == "F":
            return self.p2p.send_forward_recv_backward(tensor, [torch.Size(shape)], self.is_last)
        return self.p2p.send_backward_recv_forward(tensor, [torch.Size(shape)], self.is_first)

    def peer_received(self, direction: str, count: int) -> None:
        queue = self._sending[direction]
        while queue and self._sent[direction] - len(queue) < count:
            for handle in queue.popleft()[0]:
                handle.wait()

    def finish(self) -> None:
        for queue in self._sending.values():
            while queue:
                for handle in queue.popleft()[0]:
                    handle.wait()


def check_shared_link(lowered: LoweredSchedule) -> None:
    """Two ranks on the ring of virtual stages are each other's next and previous neighbour,
    and Megatron's communicator carries both directions between them on one channel, matched
    in order (it tags nothing): each rank must receive in the order the other sends. Raises
    ValueError, before any message, for lowered lists that do not."""
    if lowered.num_stages != 2:
        return
    for k in (0, 1):
        sent = [(a.direction, str(peer_cell(a.cell, a.direction, k, 2)))
                for a in lowered.stage(k) if a.operation == "SEND"]
        received = [(a.direction, str(a.cell)) for a in lowered.stage(1 - k)
                    if a.operation == "RECV"]
        if sent != received:
            raise ValueError(
                "TeraPipe: on 2 pipeline stages with virtual stages, Megatron's P2PCommunicator "
                "carries activations and gradients between the two ranks on one channel, but "
                f"rank {1 - k} would receive them in another order than rank {k} sends them "
                "(the plan's slices, order and microbatches): run the torch transport "
                "(config.terapipe.transport = 'torch', the default off CUDA), another plan "
                "(e.g. uniform slices or the gpipe order), or more pipeline stages")


def make_transport(pp_group, config, device: torch.device, p2p_communicator=None,
                   ring: bool = False, tp_group=None, sends_wait: bool = True) -> Transport:
    """Megatron's communicator where it works (CUDA), the device-aware torch path elsewhere;
    no transport for a one-stage pipeline. `ring`: virtual stages, where the last stage sends
    forward to the first (its next model chunk) and the first backward to the last. With
    config.terapipe.scatter_gather and TP > 1, each message goes over it in TP parts, gathered
    in `tp_group` (runtime/comm/scatter_gather.py; the rules refuse it with sequence parallelism).
    sends_wait=False: Megatron's communicator sends as on the ring, without waiting for the
    receiver (edge-sliced plans: a stage sends ahead of its neighbour's receives)."""
    from .selection import run_config

    transport = _stage_transport(pp_group, config, device, p2p_communicator, ring, sends_wait)
    if (run_config(config).scatter_gather and tp_group is not None and tp_group.size() > 1
            and pp_group is not None and pp_group.size() > 1):
        return ScatterGatherTransport(transport, tp_group)
    return transport


def _stage_transport(pp_group, config, device: torch.device, p2p_communicator,
                     ring: bool, sends_wait: bool = True) -> Transport:
    if pp_group is None or pp_group.size() == 1:
        return Transport()
    rank, size = pp_group.rank(), pp_group.size()
    from .selection import run_config

    # config.terapipe.transport ("megatron", "torch" or "host") overrides the choice, e.g. to run
    # Megatron's communicator on gloo in tests.
    choice = run_config(config).transport or ("megatron" if device.type == "cuda" else "torch")
    if choice not in ("megatron", "torch", "host"):
        raise ValueError("config.terapipe.transport must be 'megatron', 'torch' or 'host' (the "
                         f"torch transport through host memory), got {choice!r}")
    if choice in ("torch", "host"):
        return TorchTransport(pp_group, config.pipeline_dtype or torch.float32, device, ring=ring,
                              host_staged=choice == "host")
    ring = ring or not sends_wait  # the ring's sends: they do not wait
    if p2p_communicator is None or ring:
        # Shapes come from the plan, so the communicator's shape handshake is never needed;
        # on the ring sends do not wait, which Megatron's batched calls cannot do.
        p2p_config = copy.copy(getattr(p2p_communicator, "config", None) or config)
        p2p_config.variable_seq_lengths = False
        if ring:
            p2p_config.batch_p2p_comm = False
        p2p_communicator = compat.make_p2p_communicator(pp_group, p2p_config)
    return MegatronTransport(p2p_communicator, rank == 0, rank == size - 1, ring=ring)
