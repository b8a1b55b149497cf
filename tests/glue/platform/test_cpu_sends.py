"""CPU mode keeps a sent tensor's storage alive until its send is waited on
(megatron/platform/cpu_sends.py): Megatron frees stage outputs right after sending them, and gloo
reads a send's memory only when the receiver posts its receive. The control (torch.distributed
directly) shows that the check can fail: the receiver gets the memory's next contents."""

import pytest

from harness import spawn


@pytest.mark.parametrize("batched", [False, True], ids=["isend", "batch_isend_irecv"])
def test_a_freed_send_arrives_intact(batched):
    assert spawn(2, "harness.runs.cpu_sends:freed_before_received", True, batched) == [True, True]


def test_without_the_alias_the_receiver_gets_other_data():
    assert spawn(2, "harness.runs.cpu_sends:freed_before_received", False, False) == [True, False]


def test_cpu_mode_sends_through_the_kept_path():
    from megatron.core.pipeline_parallel import p2p_communication

    from megatron_terapipe.megatron.platform import cpu_mode as cpu
    from megatron_terapipe.megatron.platform import cpu_sends

    was_enabled = cpu._ENABLED
    cpu.enable_cpu_mode()
    try:
        assert p2p_communication.torch.distributed.isend is cpu_sends.isend
        assert p2p_communication.torch.distributed.batch_isend_irecv is cpu_sends.batch_isend_irecv
    finally:
        if not was_enabled:
            cpu.disable_cpu_mode()
