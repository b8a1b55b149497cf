"""Workers for tests/runtime/test_host_transport.py: TeraPipe's torch transport staged through host
memory (config.terapipe.transport = "host"), on gloo processes."""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange(rank: int, world_size: int) -> dict:
    """Rank 0 sends an activation forward and gets a gradient back through the transport that
    make_transport builds for transport "host"; what each side received and how."""
    from types import SimpleNamespace

    from megatron_terapipe.megatron.hooks.p2p import make_transport
    from megatron_terapipe.megatron.hooks.selection import TeraPipeConfig
    from megatron_terapipe.runtime.memory.buffer_pool import BufferPool

    group = dist.new_group(list(range(world_size)), backend="gloo")
    config = SimpleNamespace(pipeline_dtype=torch.float32, terapipe=TeraPipeConfig(transport="host"))
    transport = make_transport(group, config, torch.device("cpu"))
    transport.pool = BufferPool()
    shape = (2, 3)
    for round_ in range(3):  # the same host buffer serves every round's receive
        if rank == 0:
            transport.send("F", torch.arange(6.0).reshape(shape) + 10 * round_)
            got = transport.recv("B", shape)
        else:
            got = transport.recv("F", shape)
            transport.send("B", got * 2)
    transport.finish()
    return {"host_staged": transport.host_staged, "posts_early": transport.lowering.post_receives_early,
            "received": got.tolist(), "pool_slot": transport.pool.slot_of(got),
            "host_buffers": transport.host.allocated, "pinned": transport.host.pin}
