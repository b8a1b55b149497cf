"""CPU mode's pipeline sends: keep what is sent alive until the send is done.

Megatron's schedules free a stage's output right after sending it (`deallocate_output_tensor`
swaps the tensor's storage for one element), and its interleaved 1F1B overlaps sends with the
next chunk's compute. On a GPU the sent storage stays reserved until NCCL is done with it
(the caching allocator's `record_stream`); with gloo on CPU the send reads the storage when the
receiver posts its receive, by which time the freed memory may hold the next tensor: the
receiver gets garbage (a NaN loss in some runs). Here every send made through Megatron's
P2P module keeps a detached alias of the sent storage with its request until it is waited on.
TeraPipe's own torch transport does the same (runtime/comm/transport.py)."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from . import compat


class KeptSend:
    """A send's request with an alias of what it sends, dropped once waited on."""

    def __init__(self, work: Any, aliases: list[torch.Tensor]) -> None:
        self.work = work
        self.aliases = aliases

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        done = self.work.wait(*args, **kwargs)
        self.aliases = []
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> KeptSend:
    return KeptSend(dist.isend(tensor, *args, **kwargs), [tensor.detach()])


def p2p_op(op: Any, *args: Any, **kwargs: Any) -> dist.P2POp:
    """torch's P2POp, which accepts only torch's own isend and irecv."""
    return dist.P2POp(dist.isend if op is isend else op, *args, **kwargs)


def batch_isend_irecv(ops: list) -> list:
    aliases = [op.tensor.detach() for op in ops if op.op is dist.isend]
    works = dist.batch_isend_irecv(ops)
    return [KeptSend(work, aliases) for work in works] if aliases else works


class DistributedProxy(types.ModuleType):
    """`torch.distributed` as Megatron's P2P module sees it in CPU mode: isend and
    batch_isend_irecv keep the aliases; P2POp takes this isend for torch's."""

    def __init__(self) -> None:
        super().__init__("torch.distributed")

    isend = staticmethod(isend)
    P2POp = staticmethod(p2p_op)
    batch_isend_irecv = staticmethod(batch_isend_irecv)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


class P2PTorchProxy(types.ModuleType):
    """`torch` as Megatron's p2p_communication module sees it in CPU mode."""

    def __init__(self, base: types.ModuleType) -> None:
        super().__init__("torch")
        self._base = base
        self.distributed = DistributedProxy()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def p2p_module():
    """Megatron's P2P module, whose sends CPU mode keeps alive (cpu_sends.py): it must call
    torch.distributed's isend and batch_isend_irecv through its module-level `torch`."""
    from megatron.core.pipeline_parallel import p2p_communication

    compat.require_tested("CPU mode")
    if getattr(p2p_communication, "torch", None) is not torch:
        raise compat.moved("CPU mode", "pipeline_parallel.p2p_communication no longer "
                           "imports torch at module level")
    return p2p_communication
