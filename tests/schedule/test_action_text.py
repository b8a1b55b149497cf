"""One spelling of an action (format_action / parse_action), schedules in files
(dump_schedule / load_schedule), and one Chrome-trace writer and timed-action record for
predicted and measured timelines."""

from __future__ import annotations

import json
import re

import pytest
import torch

from megatron_terapipe import TeraPipePlan
from megatron_terapipe.planner import FunctionCostModel, chrome_trace, simulate
from megatron_terapipe.runtime.batching import CellData
from megatron_terapipe.runtime.executor import StageExecutor, StageModel, StageOptions
from megatron_terapipe.runtime.trace import RunRecord, gather_trace
from megatron_terapipe.runtime.comm.transport import Transport
from megatron_terapipe.schedule import (
    Action, ActionKind, Lowering, ScheduleError, TimedAction, build_interleaved_schedule,
    build_lowered_schedule, build_schedule, cells_by_name, dump_schedule, format_action,
    load_schedule, lower, parse_action)
from megatron_terapipe.schedule.validate import format_grid

GLOO = Lowering(post_receives_early=True)
MEGATRON = Lowering(fuse_send_recv=True)


def every_lowered_action(plan: TeraPipePlan, microbatches: int, stages: int, mbs: int):
    schedule = build_schedule(plan, microbatches, stages, mbs)
    lowered = [a for lowering in (Lowering(), GLOO, MEGATRON)
               for actions in lower(schedule, lowering) for a in actions]
    return schedule, lowered


def test_every_action_kind_round_trips():
    plan = TeraPipePlan([4, 4, 4], batch_slices=[1, 2], wgrad_points=[[2]])  # early and last W
    schedule, actions = every_lowered_action(plan, 2, 3, 3)
    assert {a.kind for a in actions} == set(ActionKind)  # F, B, W and every message kind
    cells = cells_by_name(schedule.cells())
    for a in actions:
        text = format_action(a)
        assert str(a) == text and parse_action(text, cells) == a
    texts = {format_action(a) for a in actions}
    assert {"F(m1b1t2)", "W(m0b0t0)", "W(m0b1t2)", "POST_F(m0b0t1)", "SEND_B(m1b1t0)"} <= texts
    fused = [t for t in texts if "_RECV_" in t]
    assert fused and all(re.fullmatch(r"SEND_([FB])_RECV_(?!\1)[FB]\(m\db\dt\d, m\db\dt\d\)", t)
                         for t in fused)


def test_chunk_cells_of_the_interleaved_schedule_round_trip():
    schedule = build_interleaved_schedule(64, 4, 2, 2, 1)
    cells = cells_by_name(a.cell for actions in schedule.stages for a in actions)
    assert set(cells) == {f"m{m}c{c}" for m in range(4) for c in range(2)}
    lowered = [a for actions in schedule.lowered() for a in actions]
    assert {a.kind for a in lowered} >= {ActionKind.F, ActionKind.B, ActionKind.SEND_F,
                                         ActionKind.RECV_B}
    for a in lowered:
        again = parse_action(format_action(a), cells)
        assert again == a and type(again.cell) is type(a.cell)
    assert format_action(schedule.stages[0][0]) == "F(m0c0)"


@pytest.mark.parametrize("text, message", [
    ("F m0 b0 t0", "cannot read the action"),
    ("X(m0b0t0)", "unknown action kind 'X'"),
    ("F(m9b0t0)", "cell 'm9b0t0'.*m0b0t0 ... m1b0t1"),
    ("SEND_F_RECV_B(m0b0t0)", "fused kinds"),
    ("F(m0b0t0, m0b0t1)", "fused kinds"),
])
def test_unreadable_actions_name_the_problem(text, message):
    cells = cells_by_name(build_schedule(TeraPipePlan([4, 4]), 2, 2, 1).cells())
    with pytest.raises(ValueError, match=message):
        parse_action(text, cells)
    assert parse_action(" SEND_B_RECV_F( m0b0t1 ,m1b0t0 ) ", cells) == Action(
        "SEND_B_RECV_F", cells["m0b0t1"], cells["m1b0t0"])


def test_the_grid_and_errors_use_the_one_spelling():
    schedule = build_schedule(TeraPipePlan([4, 4], defer_wgrad=False), 1, 2, 1)
    grid = format_grid(schedule.stages, (1, 0))
    assert ">>F(m0b0t0)<<" in grid and "B(m0b0t1)" in grid


@pytest.mark.parametrize("plan, forward_only", [
    (TeraPipePlan([4, 4, 8], batch_slices=[1, 1], wgrad_points=[[1], [2]]), False),
    (TeraPipePlan([[4, 4], [8]], batch_slices=[1, 1], order="gpipe", defer_wgrad=False), False),
    (TeraPipePlan([8, 8]), True),
])
def test_a_schedule_round_trips_through_a_file(tmp_path, plan, forward_only):
    schedule = build_schedule(plan, 3, 2, 2, forward_only)
    path = dump_schedule(schedule, tmp_path / "schedule.json")
    data = json.loads(path.read_text())
    assert data["stages"][0][0] == "F(m0b0t0)" and len(data["stages"]) == 2
    assert len(path.read_text().splitlines()) < 20  # one line per stage
    loaded = load_schedule(path, GLOO)
    assert loaded == schedule  # plan, shape and every stage's actions


def test_a_hand_edited_schedule_is_validated_when_loaded(tmp_path):
    schedule = build_schedule(TeraPipePlan([4, 4], defer_wgrad=False), 1, 2, 1)
    data = json.loads(dump_schedule(schedule, tmp_path / "s.json").read_text())
    last = data["stages"][1]
    i = last.index("B(m0b0t1)")
    last[i], last[i + 1] = last[i + 1], last[i]  # backwards out of reverse token order
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match="out of reverse token order") as error:
        load_schedule(tmp_path / "bad.json")
    assert ">>B(m0b0t0)<<" in error.value.grid
    data["stages"][1] = data["stages"][0]
    data["stages"][0] = ["F(m0b0t0)", "SEND_F(m0b0t0)"]
    (tmp_path / "talking.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="communication actions .*SEND_F"):
        load_schedule(tmp_path / "talking.json")
    (tmp_path / "other.json").write_text(json.dumps({"stages": []}))
    with pytest.raises(ValueError, match="not a schedule file"):
        load_schedule(tmp_path / "other.json")
    with pytest.raises(TypeError, match="build_interleaved_schedule"):
        dump_schedule(build_interleaved_schedule(64, 4, 2, 2, 1), tmp_path / "i.json")


class OneStage(Transport):
    """A one-stage pipeline: no messages."""


def run_one_stage(lowered, transport: Transport = OneStage()) -> RunRecord:
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 8)

    def forward_step(data_iterator, model):
        x = next(data_iterator)["x"].transpose(0, 1)
        def loss_func(out):  # summed loss, token count, report: as pretrain_gpt's
            loss = out.square().sum()
            return loss, torch.tensor(out.shape[0] * out.shape[1]), {"loss": loss.detach()}

        return model(x), loss_func

    batches = [{"x": torch.randn(2, 12, 8)} for _ in range(2)]
    executor = StageExecutor(lowered, 0, StageModel(module, forward_step, lambda inputs: None),
                             CellData(iter(batches), 12, 2), transport,
                             StageOptions(hidden_size=8), torch.device("cpu"))
    executor.run()
    return executor.record


def test_measured_and_predicted_timelines_are_one_record_and_one_trace():
    plan = TeraPipePlan([4, 8], batch_slices=[1, 1])
    lowered = build_lowered_schedule(plan, 2, 1, 2, lowering=OneStage.lowering)
    record = run_one_stage(lowered)
    assert record.actions is lowered.stages[0]  # the executor ran the lowered list it was given
    assert all(type(e) is TimedAction for e in record.events)
    assert [e.action for e in record.events] == [a for a in lowered.stages[0] if a.is_compute]
    assert all(e.kind == e.action.kind and e.cell is e.action.cell and e.end >= e.start
               for e in record.events)
    measured = gather_trace(record, None)
    cost = FunctionCostModel(lambda b, l, c: 1e-3 * b * l, transfer=lambda b, l: 0.0)
    predicted = chrome_trace(simulate(lowered.schedule, cost))
    spans = [[e for e in t["traceEvents"] if e["ph"] == "X"] for t in (measured, predicted)]
    assert [e["name"] for e in spans[0]] == [e["name"] for e in spans[1]]
    assert spans[0][0]["name"] == "F(m0b0t0)" and {e["cat"] for e in spans[0]} == {
        "forward", "backward", "weight-grad"}
    assert [set(e) for e in spans[0]] == [set(e) for e in spans[1]]
    assert [e["args"] for e in spans[0]] == [e["args"] for e in spans[1]]
    names = [{e["args"]["name"] for e in t["traceEvents"] if e["name"] == "process_name"}
             for t in (measured, predicted)]
    assert names == [{"measured stage 0"}, {"stage 0"}]


def test_the_executor_refuses_a_schedule_lowered_for_another_transport():
    lowered = build_lowered_schedule(TeraPipePlan([4, 8]), 2, 1, 2, lowering=MEGATRON)
    with pytest.raises(ValueError, match="lowered for .*fuse_send_recv=True.*OneStage"):
        run_one_stage(lowered)
