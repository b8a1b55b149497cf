"""Megatron's interleaved 1F1B as action lists (schedule/interleaved.py): the order is
Megatron-Core's own, the replay follows messages from chunk to chunk across ranks, and the
timing matches the closed form of an interleaved pipeline."""

from __future__ import annotations

import pytest

from megatron_terapipe.schedule import build_interleaved_schedule, timeline
from megatron_terapipe.schedule.interleaved import rank_order, schedule_table

SHAPES = [(2, 2, 2), (2, 4, 2), (2, 6, 3), (4, 4, 2), (4, 8, 2), (4, 12, 3), (3, 6, 2)]  # K, M, v


@pytest.mark.parametrize("K,M,v", SHAPES)
def test_table_and_warmup_are_megatrons(K, M, v):
    """The table is get_schedule_table's; each rank's warm-up count is
    get_pp_rank_microbatches'; the steady state alternates F and B as Megatron's loop does."""
    from unittest import mock

    from megatron.core.pipeline_parallel import schedules

    assert schedule_table(M, v, K) == schedules.get_schedule_table(M, v, K)
    for k in range(K):
        with mock.patch.multiple(
                schedules.parallel_state,
                get_pipeline_model_parallel_world_size=lambda: K,
                get_pipeline_model_parallel_rank=lambda: k,
                get_virtual_pipeline_model_parallel_world_size=lambda: v):
            total, _, warmup, remaining = schedules.get_pp_rank_microbatches(M, v, K)
        order = rank_order(k, K, M, v, K)
        assert len(order) == 2 * total
        assert all(kind == "F" for kind, _, _ in order[:warmup])
        steady = order[warmup:warmup + 2 * remaining]
        assert [kind for kind, _, _ in steady] == ["F", "B"] * remaining
        # backward j is table entry j with its chunk mirrored
        backwards = [(m, c) for kind, m, c in order if kind == "B"]
        assert backwards == [(m, v - 1 - c) for m, c in schedules.get_schedule_table(M, v, K)]


@pytest.mark.parametrize("K,M,v", SHAPES)
def test_closed_form_and_dependencies(K, M, v):
    """Equal chunks (forward f/v, backward b/v): M (f + b) + (K - 1)(f + b)/v, and every F of
    virtual stage s starts after the F of s - 1 ends (on rank (s - 1) % K)."""
    f, b = 1.0, 2.0
    schedule = build_interleaved_schedule(64, M, K, v, 1)
    timed = timeline(schedule, lambda k, a: (f if a.kind == "F" else b) / v)
    assert max(t.end for t in timed) == pytest.approx(M * (f + b) + (K - 1) * (f + b) / v)
    end = {(t.action.kind, t.action.cell.microbatch, t.action.cell.virtual_stage(t.stage, K)): t
           for t in timed}
    for (kind, m, s), t in end.items():
        if kind == "F" and s > 0:
            before = end[("F", m, s - 1)]
            assert before.end <= t.start + 1e-12 and before.stage == (s - 1) % K
        if kind == "B" and s < K * v - 1:
            assert end[("B", m, s + 1)].end <= t.start + 1e-12


@pytest.mark.parametrize("K,M,v,message", [
    (2, 1, 2, "at least 2 microbatches"),
    (2, 5, 2, "1 are left"),
    (1, 4, 2, "at least 2 pipeline stages"),
    (2, 4, 1, "at least 2 model chunks"),
])
def test_refuses_what_megatron_refuses(K, M, v, message):
    with pytest.raises(ValueError, match=message):
        build_interleaved_schedule(64, M, K, v, 1)


def expected_events(rank: int, K: int, M: int, v: int, forward_only: bool) -> list[tuple]:
    """What megatron_calls says `rank` runs, in the recorded events' form."""
    from megatron_terapipe.schedule.interleaved import megatron_calls

    events = []
    for call in megatron_calls(rank, K, M, v, K, forward_only):
        events += [("F", c) for kind, _, c in call.computes if kind == "F"]
        events.append(("P2P", call.send_next, call.send_prev, call.recv_prev, call.recv_next))
    return events


@pytest.mark.parametrize("K,M,v,forward_only", [(2, 4, 2, False), (2, 2, 2, False),
                                                (2, 6, 3, False), (2, 4, 2, True),
                                                (4, 4, 2, False), (4, 8, 2, False)])
def test_communication_calls_are_megatrons(K, M, v, forward_only):
    """Megatron's own interleaved schedule, run on K gloo processes and recorded: each rank's
    forward steps (by chunk) and every P2P call (what it sends, what it receives) are the
    ones megatron_calls lays out, in the same order; the lowered lists replay without a
    deadlock and every receive is of a cell its neighbour sends."""
    from harness import TinyGPT, spawn

    model = TinyGPT(num_layers=K * v, seq_length=16)
    recorded = spawn(K, "harness.runs.interleaved_runs:record_interleaved_calls", model, M, v,
                     forward_only)
    for rank in range(K):
        assert recorded[rank] == expected_events(rank, K, M, v, forward_only), f"rank {rank}"
    timeline(build_interleaved_schedule(16, M, K, v, 1, forward_only=forward_only),
             lambda k, a: 1.0)
