"""Stage-to-stage transport through Megatron's P2PCommunicator (the CUDA/NCCL path), and the
choice between it and the torch transport."""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from ...runtime.transport import TorchTransport, Transport
from ...schedule import Lowering
from . import compat


class MegatronTransport(Transport):
    """Megatron's P2PCommunicator with explicit per-cell shapes.

    Its blocking batched calls need a send and the receive right after it in one call, as
    Megatron's 1F1B does: the schedule is lowered with fused send-receive actions."""

    lowering = Lowering(fuse_send_recv=True)

    def __init__(self, communicator, is_first: bool, is_last: bool) -> None:
        self.p2p = communicator
        self.is_first = is_first
        self.is_last = is_last

    # Megatron reads a list of ints as one shape but iterates a list in its fused calls, so
    # shapes go in as torch.Size (single) or [torch.Size] (fused).
    def send(self, direction: str, tensor: torch.Tensor) -> None:
        if direction == "F":
            self.p2p.send_forward(tensor, self.is_last)
        else:
            self.p2p.send_backward(tensor, self.is_first)

    def recv(self, direction: str, shape: Sequence[int]) -> torch.Tensor:
        if direction == "F":
            return self.p2p.recv_forward(torch.Size(shape), self.is_first)
        return self.p2p.recv_backward(torch.Size(shape), self.is_last)

    def send_recv(self, direction: str, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        if direction == "F":
            return self.p2p.send_forward_recv_backward(tensor, [torch.Size(shape)], self.is_last)
        return self.p2p.send_backward_recv_forward(tensor, [torch.Size(shape)], self.is_first)


def make_transport(pp_group, config, device: torch.device, p2p_communicator=None) -> Transport:
    """Megatron's communicator where it works (CUDA), the device-aware torch path elsewhere;
    no transport for a one-stage pipeline."""
    if pp_group is None or pp_group.size() == 1:
        return Transport()
    rank, size = pp_group.rank(), pp_group.size()
    from .selection import run_config

    # config.terapipe.transport ("megatron" or "torch") overrides the choice, e.g. to run
    # Megatron's communicator on gloo in tests.
    choice = run_config(config).transport or ("megatron" if device.type == "cuda" else "torch")
    if choice not in ("megatron", "torch"):
        raise ValueError(f"config.terapipe.transport must be 'megatron' or 'torch', got {choice!r}")
    if choice == "torch":
        return TorchTransport(pp_group, config.pipeline_dtype or torch.float32, device)
    if p2p_communicator is None:
        # Shapes come from the plan, so the communicator's shape handshake is never needed.
        p2p_config = copy.copy(config)
        p2p_config.variable_seq_lengths = False
        p2p_communicator = compat.make_p2p_communicator(pp_group, p2p_config)
    return MegatronTransport(p2p_communicator, rank == 0, rank == size - 1)
