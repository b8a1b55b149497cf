"""TeraPipe on virtual stages (TeraPipePlan.virtual_stages = V > 1): the plan fields, the
chunked orders (deadlock-free for every group `allowed_group` accepts, and only those are
needed), the ring of messages, the closed form of an interleaved pipeline with equal costs,
costs and memory per chunk."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_terapipe import ScheduleError, TeraPipePlan, build_schedule, timeline, validate
from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset, simulate
from megatron_terapipe.planner.evaluate.list_estimate import estimate_lists
from megatron_terapipe.schedule import Lowering, LoweredSchedule, VirtualCell, lower
from megatron_terapipe.schedule import build as build_module
from megatron_terapipe.schedule.build import allowed_group, virtual_group

SLICINGS = [([4], None), ([4, 4, 4], None), ([[4, 4], [8]], [1, 1]), ([[2, 6], [4, 2, 2]], [1, 2])]


def plan_of(slices, batch, V, order="1f1b", group=None, defer=True, **kw) -> TeraPipePlan:
    return TeraPipePlan(slices, batch_slices=batch, order=order, virtual_stages=V,
                        virtual_group=group, defer_wgrad=defer, **kw)


def test_plan_fields_round_trip_and_are_checked():
    plan = TeraPipePlan([4, 4], virtual_stages=2, virtual_group=1, virtual_warmup=0,
                        wgrad_after=[[1, 2], [3]])
    assert TeraPipePlan.from_dict(plan.to_dict()) == plan
    assert set(TeraPipePlan([4, 4]).to_dict()) == {  # files of one-chunk plans as before
        "seq_slices", "batch_slices", "order", "predicted_time", "defer_wgrad", "wgrad_points"}
    for kwargs, message in [(dict(virtual_stages=0), "virtual_stages"),
                            (dict(virtual_stages=True), "virtual_stages"),
                            (dict(virtual_group=2), "virtual_group"),
                            (dict(virtual_stages=2, virtual_warmup=-1), "virtual_warmup"),
                            (dict(wgrad_after=[[2, 1]]), "non-decreasing"),
                            (dict(wgrad_after=[[1]], defer_wgrad=False), "defer_wgrad")]:
        with pytest.raises(ValueError, match=message):
            TeraPipePlan([4, 4], **kwargs)
    with pytest.raises(ValueError, match="virtual_stages 2 does not divide the 5 layers"):
        plan.check_layers(5)
    with pytest.raises(ValueError, match="at least 2 pipeline stages"):
        build_schedule(plan, 2, 1, 1)


def test_cells_name_their_chunk_and_sequence_keys_are_per_chunk():
    schedule = build_schedule(plan_of([4, 4], None, 3), 2, 2, 1)
    cells = schedule.cells()
    assert len(cells) == 2 * 3 * 2 and all(type(c) is VirtualCell for c in cells)
    assert str(cells[-1]) == "m1b0t1c2" and cells[-1].sequence_key == (1, 0, 2)
    assert {len(actions) for actions in schedule.stages} == {2 * len(cells) + 2 * 3 * 1}  # + W


@pytest.mark.parametrize("K", [2, 3, 5])
@pytest.mark.parametrize("V", [2, 3])
@pytest.mark.parametrize("slices,batch", SLICINGS)
def test_every_allowed_group_gives_a_valid_schedule(K, V, slices, batch):
    """Every microbatch count works (the default group always exists); every group
    allowed_group accepts validates (dependencies, slice order, messages, no deadlock), with
    Megatron's warm-up and the shorter ones (virtual_warmup)."""
    rows = sum(batch) if batch else 1
    cells = plan_of(slices, batch, V).num_cells
    for M in range(1, 8):
        groups = [g for g in range(1, M + 1) if allowed_group(g, M, K, cells)]
        assert virtual_group(plan_of(slices, batch, V), M, K) in groups
        for group in groups:
            validate(build_schedule(plan_of(slices, batch, V, "gpipe", group), M, K, rows))
            for lead in (None, 0, 1):
                plan = plan_of(slices, batch, V, "1f1b", group, virtual_warmup=lead)
                validate(build_schedule(plan, M, K, rows))


def test_groups_outside_the_rule_are_refused_and_would_deadlock(monkeypatch):
    """K=3, 1 cell per microbatch, groups of 1: fewer units per group than stages."""
    plan = plan_of([4], None, 2, group=1)
    with pytest.raises(ValueError, match="virtual_group.*at least 3 units.*virtual_group=3"):
        build_schedule(plan, 3, 3, 1)
    monkeypatch.setattr(build_module, "allowed_group", lambda *args: True)
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(build_schedule(plan, 3, 3, 1))


@pytest.mark.parametrize("K,V,T,M", [(2, 2, 1, 2), (4, 2, 1, 8), (4, 2, 2, 4), (4, 4, 2, 2),
                                     (8, 5, 1, 8), (8, 5, 4, 1), (8, 5, 8, 1), (4, 2, 3, 5)])
@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
def test_closed_form_of_an_interleaved_pipeline_with_equal_costs(K, V, T, M, order):
    """Forward f/V and backward b/V per chunk, no transfers: N = M T units take
    (N V + K - 1)(f + b)/V when they fill the ring (N >= K), else (K V + N - 1)(f + b)/V
    (a unit's trip through the K V virtual stages, the others one slot behind)."""
    f, b = 1.0, 2.0
    schedule = build_schedule(plan_of([4] * T, None, V, order, defer=False), M, K, 1)
    timed = timeline(schedule, lambda k, a: (f if a.kind == "F" else b) / V)
    N = M * T
    expected = max(N * V + K - 1, K * V + N - 1) * (f + b) / V
    assert max(t.end for t in timed) == pytest.approx(expected)


def test_dependencies_follow_the_virtual_stages():
    """F of virtual stage s starts after F of s - 1 ends, on rank (s - 1) % K; B after B of
    s + 1; a chunk's slices go forward in order and backward in reverse."""
    K, V = 3, 2
    schedule = build_schedule(plan_of([4, 4], None, V), 4, K, 1)
    timed = timeline(schedule, lambda k, a: 1.0 + 0.1 * k, lambda k, a: 0.25)
    end = {(t.kind, t.cell.microbatch, t.cell.token_slice, t.cell.virtual_stage(t.stage, K)): t
           for t in timed if t.kind != "W"}
    for (kind, m, t, s), span in end.items():
        before = {"F": (kind, m, t, s - 1), "B": (kind, m, t, s + 1)}[kind]
        if before in end:
            assert end[before].end + 0.25 <= span.start + 1e-12
            if kind == "F":
                assert end[before].stage == (s - 1) % K
        if kind == "F" and t > 0:
            assert end[("F", m, t - 1, s)].end <= span.start + 1e-12
        if kind == "B" and t == 0:
            assert end[("B", m, 1, s)].end <= span.start + 1e-12


@pytest.mark.parametrize("lowering", [Lowering(), Lowering(post_receives_early=True),
                                      Lowering(fuse_send_recv=True)])
def test_messages_go_round_the_ring_named_by_each_side(lowering):
    K, V = 3, 2
    schedule = build_schedule(plan_of([4, 4], None, V), 3, K, 1)
    lowered = validate(schedule, lowering)
    assert lowered == lower(schedule, lowering)
    last, first = lowered[K - 1], lowered[0]
    sent = [a.cell for a in last if a.operation in ("SEND", "SEND_RECV") and a.direction == "F"]
    received = [a.cell for a in first if a.kind == "RECV_F"] + [
        a.recv_cell for a in first if a.kind == "SEND_B_RECV_F"]
    assert sent and all(c.chunk == 0 for c in sent)  # the last rank's chunk 0 ...
    assert sorted(map(str, received)) == sorted(str(replace(c, chunk=1)) for c in sent)
    receives_f0 = {a.cell for a in first if a.kind in ("RECV_F", "POST_F")}
    assert all(c.chunk == 1 for c in receives_f0)  # the model's first layers receive nothing


def test_lowered_schedules_keep_virtual_stages_for_the_executor():
    """The executor runs them (tests/equivalence/test_virtual_runs.py): validated and lowered once."""
    schedule = build_schedule(plan_of([4, 4], None, 2), 2, 2, 1)
    lowered = LoweredSchedule.of(schedule, Lowering(post_receives_early=True))
    assert lowered.stages == lower(schedule, Lowering(post_receives_early=True))


COST = AnalyticCostModel(model_preset("gpt3-1b"), hardware_preset("a100"), layers_per_stage=6,
                         tensor_parallel=2)


@pytest.mark.parametrize("order,V", [("1f1b", 2), ("gpipe", 3), ("1f1b", 6)])
def test_chunks_split_each_stage_s_work_and_memory(order, V):
    """Every stage computes what it computes on one chunk (layers split V ways, edges on the
    model's first and last virtual stage, W per chunk); after gpipe's forwards a stage keeps
    every activation and K/V, as much as on one chunk (the K/V gradients then come chunk by
    chunk: a lower peak); the list estimate's peaks equal the simulator's."""
    plan = TeraPipePlan([512, 256, 256], order=order)
    one = simulate(build_schedule(plan, 4, 4, 2), COST)
    chunked = build_schedule(replace(plan, virtual_stages=V), 4, 4, 2)
    many = simulate(chunked, COST)
    assert many.busy == pytest.approx(one.busy, rel=1e-9)
    if order == "gpipe":
        forwards = 4 * plan.num_cells * V  # one memory point per forward, first
        for k in range(4):
            point, whole = many.memory[k][forwards - 1], one.memory[k][plan.num_cells * 4 - 1]
            assert point.activation_bytes == pytest.approx(whole.activation_bytes, rel=1e-9)
            assert point.kv_bytes == pytest.approx(whole.kv_bytes, rel=1e-9)
        assert max(many.peak_memory_bytes) <= max(one.peak_memory_bytes)
    assert estimate_lists(chunked, COST).peak_memory_bytes == pytest.approx(
        many.peak_memory_bytes, rel=1e-12)
    assert many.iteration_time < one.iteration_time  # a shorter fill and drain
