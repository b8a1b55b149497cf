"""The readers of what a GPU lease brings back: Megatron-LM's iteration lines
(benchmarks/megatron_lm_logs.py) and torch.profiler traces (benchmarks/trace_summary.py).

Both run here on logs and traces with known numbers: a reader that misparsed a figure would put
a wrong GPU figure in the repository."""

from __future__ import annotations

import json

import pytest
import torch

import megatron_lm_logs
import trace_summary

LINE = (" [2026-11-26 07:13:03.400360] iteration {i:8d}/      20 | consumed samples:           68 | "
        "elapsed time per iteration (ms): {ms} | learning rate: 1.500000E-05 | global batch size:"
        "     4 | lm loss: {loss} | loss scale: 1.0 | grad norm: {norm} | number of skipped "
        "iterations:   0 | number of nan iterations:   0 |\n")


def _log(path, rows) -> None:
    with open(path, "w") as f:
        f.write("> terapipe: something else\n")
        for i, (ms, loss, norm) in enumerate(rows, start=1):
            f.write(LINE.format(i=i, ms=ms, loss=loss, norm=norm))


def test_megatron_lm_logs_compare_losses_and_median_times(tmp_path):
    _log(tmp_path / "megatron_lm_terapipe.log",
         [(900.0, "1.000000E+01", "2.000"), (50.0, "8.000000E+00", "3.000"), (30.0, "7.000000E+00", "4.000"),
          (40.0, "6.000000E+00", "5.000")])
    _log(tmp_path / "megatron_lm_1f1b.log",
         [(800.0, "1.000000E+01", "2.000"), (20.0, "8.080000E+00", "3.000"), (20.0, "7.000000E+00", "4.400"),
          (20.0, "6.000000E+00", "5.000")])
    assert megatron_lm_logs.main([str(tmp_path), "--warmup", "1"]) == 0
    summary = json.load(open(tmp_path / "megatron_lm.json"))["summary"]
    assert summary["max_relative_lm_loss_difference"] == pytest.approx(0.08 / 8.08)
    assert summary["max_relative_grad_norm_difference"] == pytest.approx(0.4 / 4.4)
    assert summary["median_ms_terapipe"] == 40.0 and summary["median_ms_1f1b"] == 20.0
    assert summary["terapipe_over_1f1b_speed"] == 0.5
    # the spread of the timed iterations (the warm-up's 900 ms left out)
    spread = summary["spread_ms_terapipe"]
    assert (spread["iterations"], spread["min"], spread["max"]) == (3, 30.0, 50.0)
    assert spread["q1"] <= 40.0 <= spread["q3"] and spread["q1"] < spread["q3"]
    assert summary["spread_ms_1f1b"] == {"iterations": 3, "min": 20.0, "q1": 20.0, "q3": 20.0,
                                         "max": 20.0}


def test_megatron_lm_logs_read_the_profile_logs_and_time_through_an_iteration(tmp_path):
    # megatron-lm-profile's logs: iterations after --through ran under the profiler
    rows = [(900.0, "1.0E+01", "2.0"), (30.0, "8.0E+00", "3.0"), (50.0, "7.0E+00", "4.0"),
            (70.0, "6.0E+00", "5.0"), (5000.0, "5.0E+00", "6.0")]
    _log(tmp_path / "megatron_lm_profile_terapipe.log", rows)
    _log(tmp_path / "megatron_lm_profile_1f1b.log", [(ms / 2, loss, norm) for ms, loss, norm in rows])
    argv = [str(tmp_path), "--prefix", "megatron_lm_profile", "--warmup", "1", "--through", "4"]
    assert megatron_lm_logs.main(argv) == 0
    summary = json.load(open(tmp_path / "megatron_lm_profile_logs.json"))["summary"]
    assert (summary["median_ms_terapipe"], summary["median_ms_1f1b"]) == (50.0, 25.0)
    assert summary["timed_through_iteration"] == 4 and summary["max_relative_lm_loss_difference"] == 0
    with pytest.raises(ValueError, match="--through 9: not a logged iteration"):
        megatron_lm_logs.main(argv[:-1] + ["9"])


def test_megatron_lm_logs_refuse_a_run_that_never_trained(tmp_path):
    (tmp_path / "megatron_lm_terapipe.log").write_text("Traceback ...\n")
    _log(tmp_path / "megatron_lm_1f1b.log", [(1.0, "1.0", "1.0")])
    with pytest.raises(ValueError, match="megatron_lm_terapipe.log: no Megatron-LM iteration lines"):
        megatron_lm_logs.main([str(tmp_path)])


def _event(name, cat, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_trace_summary_counts_device_busy_time_launches_syncs_and_self_time(tmp_path):
    events = [
        _event("ProfilerStep#8", "user_annotation", 0, 10_000),
        _event("aten::linear", "cpu_op", 100, 3_000),         # 1 ms of its own
        _event("aten::mm", "cpu_op", 200, 2_000),             # nested: 2 ms
        _event("cudaLaunchKernel", "cuda_runtime", 300, 10),
        _event("cudaLaunchKernel", "cuda_runtime", 400, 10),
        _event("cudaStreamSynchronize", "cuda_runtime", 5_000, 100),
        _event("gemm", "kernel", 1_000, 2_000, tid=7),          # 1.0-3.0 ms
        _event("gemm", "kernel", 2_000, 2_000, tid=8),          # overlaps: busy to 4.0 ms
        _event("copy", "gpu_memcpy", 6_000, 500, tid=7),        # +0.5 ms
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = trace_summary.summarize(str(path))
    assert (summary.steps, summary.wall_ms) == (1, 10.0)
    assert summary.gpu_busy_ms == pytest.approx(3.5)
    assert (summary.kernels, summary.launches) == (2, 2)
    assert summary.syncs == {"cudaStreamSynchronize": 1}
    assert summary.top_host_ops_ms == [("aten::mm", 2.0, 1), ("aten::linear", 1.0, 1)]


def test_trace_summary_reads_a_real_torch_profiler_trace(tmp_path):
    x = torch.randn(16, 16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(3):
            (x @ x).sum().backward()
    path = str(tmp_path / "cpu.json")
    profiler.export_chrome_trace(path)
    summary = trace_summary.summarize(path)
    names = {name: calls for name, _, calls in summary.top_host_ops_ms}
    assert names.get("aten::mm", 0) >= 3  # the forward's and the backward's products
    assert summary.gpu_busy_ms == 0.0 and summary.kernels == 0


def test_trace_summary_names_the_source_lines_behind_the_top_ops_and_the_syncs(tmp_path):
    # with_stack traces: an op's caller is the innermost Python frame of a source file outside
    # torch; the host time inside the syncs is summed (a sync's time is the host waiting)
    py = "python_function"
    events = [
        _event("ProfilerStep#3", "user_annotation", 0, 20_000),
        _event("megatron_terapipe/runtime/batching.py(100): is_plain_causal", py, 100, 9_000),
        _event("torch/functional.py(7): wrapper", py, 150, 8_000),   # torch's own: skipped
        _event("<built-in method equal>", py, 200, 7_000),           # no source: skipped
        _event("aten::equal", "cpu_op", 300, 6_000),
        _event("cudaStreamSynchronize", "cuda_runtime", 400, 5_000),
        _event("pretrain_gpt.py(50): get_batch", py, 10_000, 5_000),
        _event("aten::equal", "cpu_op", 10_100, 1_000),
        _event("aten::copy_", "cpu_op", 12_000, 500),                  # one more op, same frame
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = trace_summary.summarize(str(path))
    assert summary.sync_wait_ms == {"cudaStreamSynchronize": 5.0}
    assert summary.callers_ms["aten::equal"] == [
        ("megatron_terapipe/runtime/batching.py(100): is_plain_causal", 6.0, 1),
        ("pretrain_gpt.py(50): get_batch", 1.0, 1)]
    assert summary.callers_ms["cudaStreamSynchronize"] == [
        ("megatron_terapipe/runtime/batching.py(100): is_plain_causal", 5.0, 1)]
    assert summary.callers_ms["aten::copy_"] == [("pretrain_gpt.py(50): get_batch", 0.5, 1)]
