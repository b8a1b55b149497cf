"""Chrome trace and PNG exports of a simulated schedule."""

from __future__ import annotations

import json

import pytest

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner import FunctionCostModel, chrome_trace, simulate, write_chrome_trace, write_png
from megatron_terapipe.schedule import build_schedule


def small_result(order="1f1b"):
    plan = TeraPipePlan([64, 32, 32], batch_slices=[2, 1], order=order)
    cost = FunctionCostModel(lambda b, l, c: 1e-3 * b * l + 1e-4 * c,
                             transfer=lambda b, l: 1e-5 * b * l)
    return simulate(build_schedule(plan, 2, 3, 3), cost)


def test_chrome_trace_events(tmp_path):
    result = small_result()
    trace = chrome_trace(result)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(result.timeline)
    names = {e["name"] for e in complete}
    assert {"F(m0b0t1)", "B(m1b1t2)"} <= names
    by_stage = {e["pid"] for e in complete}
    assert by_stage == {0, 1, 2}
    process_names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                     if e["ph"] == "M" and e["name"] == "process_name"}
    assert process_names == {0: "stage 0", 1: "stage 1", 2: "stage 2"}
    for e, ta in zip(complete, result.timeline):
        assert e["ts"] == pytest.approx(ta.start * 1e6)
        assert e["dur"] == pytest.approx((ta.end - ta.start) * 1e6)
        assert e["args"]["tokens"] == ta.action.cell.tokens
        assert e["args"]["context"] == ta.action.cell.context
    # events never overlap on one stage
    for k in range(3):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in complete if e["pid"] == k)
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert counters and all(set(e["args"]) == {"activations", "kv"} for e in counters)
    path = write_chrome_trace(result, tmp_path / "trace.json")
    assert json.loads(path.read_text())["traceEvents"]


def test_png_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    for order in ("1f1b", "gpipe"):
        path = write_png(small_result(order), tmp_path / f"{order}.png")
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
