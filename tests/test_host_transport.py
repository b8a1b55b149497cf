"""TeraPipe's torch transport staged through host memory (config.terapipe.transport = "host",
for pipeline stages that share one GPU, where NCCL refuses two ranks on one device): make_transport
builds it, it posts receives early (all of its traffic is gloo's), and a message sent forward and
one sent back arrive intact, each received into a buffer of the executor's pool."""

from harness import spawn


def test_the_host_transport_moves_messages_both_ways():
    rank0, rank1 = spawn(2, "harness.host_transport:exchange")
    for side in (rank0, rank1):
        assert side["host_staged"] and side["posts_early"]
        assert side["pool_slot"] is not None
    assert rank1["received"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert rank0["received"] == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
