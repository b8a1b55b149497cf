"""Stage-to-stage transfers through host memory, for pipelines whose stages share one GPU.

Several stage processes on one GPU (under CUDA MPS) cannot use NCCL ("Duplicate GPU detected"),
and gloo cannot send CUDA tensors. `HostStagedP2PCommunicator` is a Megatron-Core
`P2PCommunicator` whose transfers copy CUDA tensors into pinned host buffers, move them with
gloo, and copy them back to the GPU. Megatron's own 1F1B takes it through its
`p2p_communicator=` argument, unmodified; `forward_backward_terapipe` takes the same object
(its Megatron transport), so both schedules pay the same transfer cost. On CPU tensors it is
plain gloo, which is how the tests check it.

This is a benchmark tool, not the product's transport: it overrides the communicator's private
`_communicate` (checked against megatron-core 0.16).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, _p2p_ops


class _PinnedPool:
    """Pinned host buffers by (shape, dtype): pinning is slow, so each shape is pinned once."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, shape, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(key[0], dtype=dtype, pin_memory=torch.cuda.is_available())
        return self.buffers[key]


class HostStagedP2PCommunicator(P2PCommunicator):
    """P2PCommunicator over gloo for tensors on any device (see module docstring)."""

    def __init__(self, pp_group: dist.ProcessGroup, config) -> None:
        if "gloo" not in str(dist.get_backend(pp_group)):  # "gloo" or "cpu:gloo,cuda:nccl"
            raise ValueError("HostStagedP2PCommunicator moves host tensors with gloo: build the "
                             "pipeline group with backend='gloo' (or 'cpu:gloo,cuda:nccl')")
        super().__init__(pp_group, config)
        self.send_pool = {"prev": _PinnedPool(), "next": _PinnedPool()}
        self.recv_pool = {"prev": _PinnedPool(), "next": _PinnedPool()}
        self.bytes_moved = 0
        self.transfers = 0

    def _to_host(self, tensor: Optional[torch.Tensor], side: str) -> Optional[torch.Tensor]:
        if tensor is None:
            return None
        tensor = tensor.detach()
        self.transfers += 1
        self.bytes_moved += tensor.numel() * tensor.element_size()
        if tensor.device.type == "cpu":
            return tensor.contiguous()
        buf = self.send_pool[side].get(tensor.shape, tensor.dtype)
        buf.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # gloo reads the buffer from the host
        return buf

    def _recv_buffer(self, wanted: bool, shape, side: str) -> Optional[torch.Tensor]:
        if not wanted:
            return None
        dtype = self.config.pipeline_dtype
        if not torch.cuda.is_available():
            return torch.empty(tuple(shape), dtype=dtype)
        return self.recv_pool[side].get(shape, dtype)

    def _to_device(self, buf: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if buf is None:
            return None
        if torch.cuda.is_available():
            # A blocking copy: the pooled host buffer is reused by the next receive.
            buf = buf.to(torch.device("cuda", torch.cuda.current_device()))
        return buf.requires_grad_()

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev: bool,
                     recv_next: bool, tensor_shape, wait_on_reqs: bool = True):
        send_next = self._to_host(tensor_send_next, "next")
        send_prev = self._to_host(tensor_send_prev, "prev")
        recv_prev_buf = self._recv_buffer(recv_prev, tensor_shape, "prev")
        recv_next_buf = self._recv_buffer(recv_next, tensor_shape, "next")
        reqs = _p2p_ops(tensor_send_prev=send_prev, tensor_recv_prev=recv_prev_buf,
                        tensor_send_next=send_next, tensor_recv_next=recv_next_buf,
                        group=self.pp_group, prev_pipeline_rank=self.prev_rank,
                        next_pipeline_rank=self.next_rank)
        for req in reqs.values():
            req.wait()
        return self._to_device(recv_prev_buf), self._to_device(recv_next_buf), None
