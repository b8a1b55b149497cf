"""Workers for tests/glue/platform/test_cpu_sends.py: a send whose tensor is freed before the
receiver posts."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

N = 1 << 18  # 1 MiB of fp32: large enough that the freed block is handed out again


def freed_before_received(rank: int, world_size: int, keep: bool, batched: bool) -> bool:
    """Rank 0 sends 0..N-1, frees the tensor's storage as deallocate_output_tensor does and
    fills new tensors of the same size with -1; rank 1 posts its receive later. Whether rank 1
    got what was sent."""
    from megatron_terapipe.megatron.platform import cpu_sends
    from megatron_terapipe.megatron.platform.cpu_mode import keep_freed_host_memory

    keep_freed_host_memory()
    api = cpu_sends if keep else dist
    if rank == 0:
        sent = torch.arange(N, dtype=torch.float32)
        if batched:
            # as Megatron's _batched_p2p_ops makes it: P2POp(torch.distributed.isend, ...)
            make_op = cpu_sends.DistributedProxy().P2POp if keep else dist.P2POp
            reqs = api.batch_isend_irecv([make_op(api.isend, sent, 1)])
        else:
            reqs = [api.isend(sent, 1)]
        sent.data = torch.empty(1)  # Megatron's deallocate_output_tensor
        junk = [torch.full((N,), -1.0) for _ in range(4)]
        dist.barrier()
        for req in reqs:
            req.wait()
        del junk
        return True
    dist.barrier()
    time.sleep(0.2)
    got = torch.zeros(N)
    dist.recv(got, 0)
    return bool(torch.equal(got, torch.arange(N, dtype=torch.float32)))
