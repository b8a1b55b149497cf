"""The schedule representation: plans, per-stage action lists, validation and timing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_terapipe import ScheduleError, TeraPipePlan, build_schedule, timeline, validate
from megatron_terapipe.schedule import Action, Cell, Schedule


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_slices=[]), "empty"),
    (dict(seq_slices=[4, 0, 4]), "positive"),
    (dict(seq_slices=[4, -2]), "positive"),
    (dict(seq_slices=[4, 4], order="zigzag"), "order must be one of"),
    (dict(seq_slices=[4, 4], batch_slices=[2, 0]), "positive"),
    (dict(seq_slices=[[4, 4], [8]], batch_slices=[1, 1, 1]), "one list per entry"),
    (dict(seq_slices=[[4, 4], [6]], batch_slices=[1, 1]), "same sequence length"),
    (dict(seq_slices=[4, [4]]), "mixes numbers and lists"),
    (dict(seq_slices=[4.5, 3.5]), "whole numbers"),
])
def test_plan_rejects_malformed_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TeraPipePlan(**kwargs)


def test_plan_validate_names_the_fix():
    plan = TeraPipePlan([8, 8], batch_slices=[1, 2])
    with pytest.raises(ValueError, match="sum to 16 tokens but seq_length is 32"):
        plan.validate(32, 3)
    with pytest.raises(ValueError, match="sum to 3 rows but micro_batch_size is 4"):
        plan.validate(16, 4)
    with pytest.raises(ValueError, match="multiples of 3"):
        TeraPipePlan([9, 7]).validate(16, 1, multiple_of=3)
    plan.validate(16, 3)


def test_uniform_plan():
    assert TeraPipePlan.uniform(2048, 3, multiple_of=8).seq_slices == (688, 680, 680)
    with pytest.raises(ValueError, match="at most 4 slices"):
        TeraPipePlan.uniform(32, 5, multiple_of=8)


def test_plan_round_trips_through_json():
    plan = TeraPipePlan([[8, 8], [4, 12]], batch_slices=[2, 1], order="gpipe", predicted_time=1.5)
    again = TeraPipePlan.from_dict(plan.to_dict())
    assert again == plan and again.token_slices == ((8, 8), (4, 12))


plans = st.builds(  # forward and backward cells only (no W actions)
    lambda slices, batch, order: TeraPipePlan(
        seq_slices=slices if batch is None else [slices] * len(batch),
        batch_slices=batch, order=order, defer_wgrad=False),
    st.lists(st.integers(1, 5), min_size=1, max_size=4),
    st.one_of(st.none(), st.lists(st.integers(1, 2), min_size=1, max_size=3)),
    st.sampled_from(["1f1b", "gpipe"]),
)


@settings(max_examples=150, deadline=None)
@given(plan=plans, microbatches=st.integers(1, 5), stages=st.integers(1, 5))
def test_every_built_schedule_is_valid_and_bubble_optimal(plan, microbatches, stages):
    mbs = sum(plan.batch_slices) if plan.batch_slices else 2
    schedule = build_schedule(plan, microbatches, stages, mbs)
    validate(schedule)
    # Unit-time cells: both orders reach the pipeline optimum (cells + stages - 1) per direction.
    spans = timeline(schedule, lambda k, a: 1.0)
    cells = microbatches * plan.num_cells
    assert max(s.end for s in spans) == 2 * (cells + stages - 1)


@settings(max_examples=100, deadline=None)
@given(plan=plans, microbatches=st.integers(1, 5), stages=st.integers(1, 5))
def test_last_stage_forwards_a_whole_microbatch_before_its_first_backward(plan, microbatches, stages):
    """Exact loss normalisation needs the microbatch's token count before its first backward."""
    mbs = sum(plan.batch_slices) if plan.batch_slices else 2
    actions = build_schedule(plan, microbatches, stages, mbs).stages[-1]
    for m in range(microbatches):
        first_b = min(i for i, a in enumerate(actions) if a.kind == "B" and a.cell.microbatch == m)
        last_f = max(i for i, a in enumerate(actions) if a.kind == "F" and a.cell.microbatch == m)
        assert last_f < first_b


def test_1f1b_bounds_cells_in_flight():
    plan = TeraPipePlan([4, 4, 4])
    schedule = build_schedule(plan, 6, 3, 1)
    for k, actions in enumerate(schedule.stages):
        live, peak = 0, 0
        for a in actions:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == plan.num_cells + (3 - k - 1)
    gpipe = build_schedule(TeraPipePlan([4, 4, 4], order="gpipe"), 6, 3, 1)
    assert sum(1 for a in gpipe.stages[0] if a.kind == "F") == 18


def _replace(schedule: Schedule, stage: int, actions) -> Schedule:
    stages = list(schedule.stages)
    stages[stage] = tuple(actions)
    return Schedule(schedule.plan, schedule.num_microbatches, schedule.micro_batch_size,
                    schedule.forward_only, tuple(stages))


def test_validate_rejects_broken_orders():
    good = build_schedule(TeraPipePlan([4, 4], order="gpipe", defer_wgrad=False), 1, 2, 1)
    validate(good)
    f0, f1, b1, b0 = good.stages[1]
    with pytest.raises(ScheduleError, match="reverse token order"):
        validate(_replace(good, 1, [f0, f1, b0, b1]))
    with pytest.raises(ScheduleError, match="before the token slices before it"):
        validate(_replace(good, 1, [f1, f0, b1, b0]))
    with pytest.raises(ScheduleError, match="before its forward"):
        validate(_replace(good, 1, [f0, b1, f1, b0]))
    with pytest.raises(ScheduleError, match="twice"):
        validate(_replace(good, 1, [f0, f1, b1, b1]))
    # Stage 0 waits for a gradient that stage 1 only sends after stage 0's next forward.
    s0 = good.stages[0]
    deadlock = _replace(good, 0, [s0[0], Action("B", s0[1].cell), Action("F", s0[1].cell), s0[3]])
    with pytest.raises(ScheduleError):
        validate(deadlock)


def test_schedule_errors_show_the_grid_with_the_failing_step_marked():
    good = build_schedule(TeraPipePlan([4, 4], order="gpipe", defer_wgrad=False), 1, 2, 1)
    f0, f1, b1, b0 = good.stages[1]
    with pytest.raises(ScheduleError) as info:
        validate(_replace(good, 1, [f0, f1, b0, b1]))  # stage 1, step 2 is out of order
    message, *rows = str(info.value).splitlines()
    assert message == info.value.message and "reverse token order" in message
    assert rows[0].split() == ["step", "|", "stage", "0", "|", "stage", "1"]
    marked = [row for row in rows if "<- here" in row]
    assert len(marked) == 1 and marked[0].startswith("   2 |")
    stage0, stage1 = (cell.strip() for cell in marked[0].removesuffix("<- here").split("|")[1:])
    assert stage0 == str(good.stages[0][2]) and stage1 == f">>{b0}<<"
    assert len(rows) == 1 + 4  # the header and every step of this short schedule
    # A deadlock has no one failing step: the grid comes unmarked. Stage 0 waits for m0's
    # gradient before it sends m1; stage 1 waits for m1 before it sends m0's gradient.
    two = build_schedule(TeraPipePlan([8], order="gpipe", defer_wgrad=False), 2, 2, 1)
    f_m0, f_m1, b_m1, b_m0 = two.stages[0]
    g_m0, g_m1, c_m1, c_m0 = two.stages[1]
    deadlock = _replace(_replace(two, 0, [f_m0, b_m0, f_m1, b_m1]), 1, [g_m0, g_m1, c_m0, c_m1])
    with pytest.raises(ScheduleError, match="deadlocks") as info:
        validate(deadlock)
    assert "step | stage 0" in str(info.value) and "<- here" not in str(info.value)


def test_long_schedules_show_the_rows_around_the_mark():
    from megatron_terapipe.schedule.validate import format_grid

    schedule = build_schedule(TeraPipePlan([1] * 40, order="gpipe", defer_wgrad=False), 1, 2, 1)
    text = format_grid(schedule.stages, (0, 50)).splitlines()
    assert "  ... 44 earlier steps" in text and "  ... 23 later steps" in text
    assert [row for row in text if "<- here" in row][0].startswith("  50 |")


def test_timeline_adds_transfer_delays():
    schedule = build_schedule(TeraPipePlan([4, 4], order="gpipe", defer_wgrad=False), 1, 2, 1)
    spans = timeline(schedule, lambda k, a: 1.0, lambda k, a: 0.5)
    # two cells, two stages: F F on stage 0, then stage 1 starts after 1 + 0.5
    starts = {(s.stage, str(s.action)): s.start for s in spans}
    assert starts[(1, "F(m0b0t0)")] == 1.5
    assert max(s.end for s in spans) == pytest.approx(2 * (2 + 1) + 2 * 0.5 * 1 + 0.0)


@settings(max_examples=60, deadline=None)
@given(plan=plans, microbatches=st.integers(1, 4), stages=st.integers(1, 4),
       costs=st.lists(st.floats(0.1, 3.0), min_size=2, max_size=2))
def test_shared_timeline_limits(plan, microbatches, stages, costs):
    """Enough cores: the ordinary timeline. One core: exactly the total work (no idle core)."""
    from megatron_terapipe.schedule import shared_timeline

    mbs = sum(plan.batch_slices) if plan.batch_slices else 2
    schedule = build_schedule(plan, microbatches, stages, mbs)
    cost = lambda k, a: costs[0] * a.cell.tokens if a.kind == "F" else costs[1] * a.cell.tokens
    alone = max(s.end for s in timeline(schedule, cost))
    assert max(s.end for s in shared_timeline(schedule, cost, cores=stages)) == pytest.approx(alone)
    work = sum(cost(k, a) for k, acts in enumerate(schedule.stages) for a in acts)
    assert max(s.end for s in shared_timeline(schedule, cost, cores=1.0)) == pytest.approx(work)


def test_action_kinds_are_an_enum_that_reads_as_its_names():
    from megatron_terapipe.schedule import ActionKind
    from megatron_terapipe.schedule.actions import send_recv

    cell = Cell(0, 0, 0, 0, 1, 0, 8, 1)
    action = Action("F", cell)
    assert action.kind is ActionKind.F and action.kind == "F" and action.is_compute
    fused = send_recv("B", cell, cell)
    assert fused.kind is ActionKind.SEND_B_RECV_F and fused.operation == "SEND_RECV"
    assert str(fused) == "SEND_B_RECV_F(m0b0t0, m0b0t0)" and f"{action.kind:>3}" == "  F"
    with pytest.raises(ValueError, match="unknown action kind 'FWD': one of F, B, W, SEND_F"):
        Action("FWD", cell)
