"""Lowering the schedule to communication actions, and replaying the lowered lists.

Two references written out here, as the executor and the timing engine were before the
schedule was lowered, pin the lowered lists down:
- the transport calls the executor made (receives posted ahead of the compute they overlap on
  gloo, Megatron's fused send-receive calls) must be the lowered list's actions, in order;
- the timeline of the cell dependency graph must be the replay of the lowered lists.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_terapipe import ScheduleError, TeraPipePlan, build_schedule, timeline, validate
from megatron_terapipe.schedule import Action, Lowering, Schedule, lower, lower_stage, shared_timeline

GLOO = Lowering(post_receives_early=True)
MEGATRON = Lowering(fuse_send_recv=True)

plans = st.builds(
    lambda slices, batch, order, defer: TeraPipePlan(
        seq_slices=slices if batch is None else [slices] * len(batch),
        batch_slices=batch, order=order, defer_wgrad=defer),
    st.lists(st.integers(1, 5), min_size=1, max_size=4),
    st.one_of(st.none(), st.lists(st.integers(1, 2), min_size=1, max_size=3)),
    st.sampled_from(["1f1b", "gpipe"]),
    st.booleans(),
)


def _schedule(plan: TeraPipePlan, microbatches: int, stages: int, forward_only: bool = False):
    mbs = sum(plan.batch_slices) if plan.batch_slices else 2
    return build_schedule(plan, microbatches, stages, mbs, forward_only)


# ---- the transport calls of the executor before lowering -----------------------------------------
def reference_calls(actions, stage: int, num_stages: int, posts_ahead: bool, fused: bool):
    """The transport calls the unlowered executor made for one stage's compute actions: before
    each F or B it received the input (unless a fused call had), then posted the next input
    and next gradient receive (gloo; the transport skipped a direction already posted), and
    after it sent the result, fused with the next action's receive when that is the opposite
    kind. Returns (call, direction, cell[, received cell]) tuples and the compute actions."""
    first, last = stage == 0, stage == num_stages - 1
    calls, posted, pending = [], {"F": None, "B": None}, None
    for i, a in enumerate(actions):
        if a.kind == "W":
            calls.append(("W", a.cell))
            continue
        needs_input = not first if a.kind == "F" else not last
        if needs_input and pending != (a.kind, a.cell):
            calls.append(("recv", a.kind, a.cell))
        if needs_input:
            posted[a.kind] = None
        pending = None
        for d, receives in (("F", not first), ("B", not last)):
            nxt = next((b.cell for b in actions[i + 1:] if b.kind == d), None)
            if posts_ahead and receives and nxt is not None and posted[d] is None:
                calls.append(("post", d, nxt))
                posted[d] = nxt
        calls.append((a.kind, a.cell))
        if (a.kind == "F" and last) or (a.kind == "B" and first):
            continue
        other = "B" if a.kind == "F" else "F"
        following = actions[i + 1] if i + 1 < len(actions) else None
        if following is not None and following.kind == other:
            pending = (other, following.cell)
            posted[other] = None
            calls += ([("send_recv", a.kind, a.cell, following.cell)] if fused
                      else [("send", a.kind, a.cell), ("recv", other, following.cell)])
        else:
            calls.append(("send", a.kind, a.cell))
    return calls


def as_calls(lowered: tuple[Action, ...]):
    names = {"SEND": "send", "RECV": "recv", "POST": "post", "SEND_RECV": "send_recv"}
    out = []
    for a in lowered:
        if a.is_compute:
            out.append((a.kind, a.cell))
        elif a.recv_cell is not None:
            out.append(("send_recv", a.direction, a.cell, a.recv_cell))
        else:
            out.append((names[a.operation], a.direction, a.cell))
    return out


@settings(max_examples=150, deadline=None)
@given(plan=plans, microbatches=st.integers(1, 4), stages=st.integers(1, 4),
       forward_only=st.booleans())
def test_lowered_lists_make_the_executors_transport_calls(plan, microbatches, stages, forward_only):
    schedule = _schedule(plan, microbatches, stages, forward_only)
    for k, actions in enumerate(schedule.stages):
        # gloo: posts, and the torch transport's fused call was a send then a receive
        assert as_calls(lower_stage(schedule, k, GLOO)) == reference_calls(
            actions, k, stages, posts_ahead=True, fused=False)
        assert as_calls(lower_stage(schedule, k, MEGATRON)) == reference_calls(
            actions, k, stages, posts_ahead=False, fused=True)
        assert as_calls(lower_stage(schedule, k)) == reference_calls(
            actions, k, stages, posts_ahead=False, fused=False)


@settings(max_examples=100, deadline=None)
@given(plan=plans, microbatches=st.integers(1, 4), stages=st.integers(2, 4))
def test_every_receive_but_the_first_input_is_posted_ahead_on_gloo(plan, microbatches, stages):
    """What the equivalence cases assert of the torch transport's counts."""
    schedule = _schedule(plan, microbatches, stages)
    cells = microbatches * plan.num_cells
    for k in range(stages):
        lowered = lower_stage(schedule, k, GLOO)
        receives = [a for a in lowered if a.operation == "RECV"]
        assert len(receives) == cells * ((k > 0) + (k < stages - 1))
        posted, early = set(), 0
        for a in lowered:
            if a.operation == "POST":
                posted.add((a.direction, a.cell))
            elif a.operation == "RECV":
                early += (a.direction, a.cell) in posted
        assert early >= len(receives) - 1


def test_lowering_reads_like_megatrons_1f1b():
    schedule = build_schedule(TeraPipePlan([4, 4], defer_wgrad=False), 1, 2, 1)
    assert [str(a) for a in lower_stage(schedule, 0, MEGATRON)] == [
        "F(m0b0t0)", "SEND_F(m0b0t0)", "F(m0b0t1)", "SEND_F_RECV_B(m0b0t1, m0b0t1)", "B(m0b0t1)",
        "RECV_B(m0b0t0)", "B(m0b0t0)"]
    assert [str(a) for a in lower_stage(schedule, 1, GLOO)] == [
        "RECV_F(m0b0t0)", "POST_F(m0b0t1)", "F(m0b0t0)", "RECV_F(m0b0t1)", "F(m0b0t1)",
        "B(m0b0t1)", "SEND_B(m0b0t1)", "B(m0b0t0)", "SEND_B(m0b0t0)"]


# ---- validate on the lowered lists ----------------------------------------------------------------
def test_validate_rejects_stages_that_exchange_messages_in_different_orders():
    """Transports match messages in order: stage 1 must forward the microbatches in the order
    stage 0 sends them, or it computes on the wrong activations."""
    good = build_schedule(TeraPipePlan([8]), 2, 2, 1, forward_only=True)
    validate(good)
    stages = (good.stages[0], tuple(reversed(good.stages[1])))
    with pytest.raises(ScheduleError, match="different orders"):
        validate(Schedule(good.plan, 2, 1, True, stages))


# ---- the timing engine replays the lowered lists ----------------------------------------------------
def reference_timeline(schedule, compute_time, transfer_time):
    """List scheduling of the cell dependency graph, as the timing engine was before lowering:
    F(c) on k after F(c) on k-1 plus its transfer, B(c) after B(c) on k+1 plus its transfer."""
    K = schedule.num_stages
    pos, free, out = [0] * K, [0.0] * K, []
    finished: dict[tuple, float] = {}
    while any(pos[k] < len(schedule.stages[k]) for k in range(K)):
        progressed = False
        for k in range(K):
            while pos[k] < len(schedule.stages[k]):
                a = schedule.stages[k][pos[k]]
                src = {"F": k - 1, "B": k + 1}.get(a.kind)
                start = free[k]
                if src is not None and 0 <= src < K:
                    if (src, a.kind, a.cell) not in finished:
                        break
                    start = max(start, finished[(src, a.kind, a.cell)]
                                + transfer_time(src, a))
                end = start + compute_time(k, a)
                finished[(k, a.kind, a.cell)] = end
                out.append((k, a, start, end))
                free[k], pos[k], progressed = end, pos[k] + 1, True
        assert progressed
    return out


@settings(max_examples=100, deadline=None)
@given(plan=plans, microbatches=st.integers(1, 4), stages=st.integers(1, 4),
       seed=st.integers(0, 1000))
def test_replay_of_the_lowered_lists_is_the_dependency_timeline(plan, microbatches, stages, seed):
    rng = random.Random(seed)
    costs = {kind: rng.uniform(0.1, 2.0) for kind in "FBW"}
    compute = lambda k, a: costs[a.kind] * (1 + 0.1 * k) * a.cell.tokens
    transfer = lambda k, a: 0.05 * a.cell.tokens * (1 + k)
    schedule = _schedule(plan, microbatches, stages)
    replayed = [(t.stage, t.action, t.start, t.end)
                for t in timeline(schedule, compute, transfer)]
    assert replayed == reference_timeline(schedule, compute, transfer)


@settings(max_examples=60, deadline=None)
@given(plan=plans, microbatches=st.integers(1, 3), stages=st.integers(1, 4))
def test_lowering_choices_do_not_change_the_times(plan, microbatches, stages):
    """Posts take no time and fused calls replay as their send then their receive, in both
    engines (in the processor-sharing one, a stage scanned before the sender still starts at
    the send's time)."""
    schedule = _schedule(plan, microbatches, stages)
    compute = lambda k, a: {"F": 1.0, "B": 2.0, "W": 0.5}[a.kind] * a.cell.tokens
    transfer = lambda k, a: 0.3 * a.cell.tokens
    for engine, extra in ((timeline, {}), (shared_timeline, {"cores": 1.5})):
        spans = [[(t.stage, t.action, t.start, t.end)
                  for t in engine(schedule, compute, transfer, lowering=lowering, **extra)]
                 for lowering in (Lowering(), GLOO, MEGATRON)]
        assert spans[0] == spans[1] == spans[2]


def test_lower_covers_every_stage():
    schedule = build_schedule(TeraPipePlan([4, 4]), 2, 3, 1)
    assert lower(schedule, GLOO) == tuple(lower_stage(schedule, k, GLOO) for k in range(3))
