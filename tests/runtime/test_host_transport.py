"""TeraPipe's torch transport staged through host memory (config.terapipe.transport = "host",
for pipeline stages that share one GPU, where NCCL refuses two ranks on one device): make_transport
builds it, it posts receives early (all of its traffic is gloo's), and a message sent forward and
one sent back arrive intact, each received into a buffer of the executor's pool, through one
host buffer reused round after round."""

import pytest
import torch

from harness import spawn
from megatron_terapipe.runtime.comm.transport import HostBuffers


def test_the_host_transport_moves_messages_both_ways():
    rank0, rank1 = spawn(2, "harness.runs.host_transport:exchange")
    for side in (rank0, rank1):
        assert side["host_staged"] and side["posts_early"]
        assert side["pool_slot"] is not None
        assert side["host_buffers"] == 1 and not side["pinned"]  # CPU: nothing to pin
    assert rank1["received"] == [[20.0, 21.0, 22.0], [23.0, 24.0, 25.0]]  # the last round's
    assert rank0["received"] == [[40.0, 42.0, 44.0], [46.0, 48.0, 50.0]]


class _Copy:
    """A stand-in CUDA event of a copy that finishes when told."""

    def __init__(self):
        self.finished = False

    def query(self):
        return self.finished


def test_a_host_buffer_is_reused_only_after_the_copy_reading_it_is_done():
    buffers = HostBuffers(pin=False)
    first = buffers.take((2, 3), torch.float32)
    copy = _Copy()
    buffers.give(first, copy)
    second = buffers.take((2, 3), torch.float32)  # the copy still reads `first`
    assert second is not first and buffers.allocated == 2
    copy.finished = True
    assert buffers.take((2, 3), torch.float32) is first
    buffers.give(second)
    assert buffers.take((3, 2), torch.float32) is not second  # another shape: its own buffers
    assert buffers.take((2, 3), torch.bfloat16).dtype == torch.bfloat16 and buffers.allocated == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to pin host memory")
def test_host_buffers_are_pinned_on_a_gpu():
    assert HostBuffers(pin=True).take((4,), torch.float32).is_pinned()
