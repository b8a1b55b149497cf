"""The harness's worker start (tests/harness/spawn.py): each worker has its caller's environment
as at the call, plus its rank's additions, before anything else runs; the GPU pipeline
benchmark gives each stage process its MPS SM share that way (benchmarks/mps.py), since a
share set inside the worker comes after NCCL's process-group set-up has asked the CUDA driver
for its devices, and MPS then ignores it (the 2- and 4-stage layer profiles then measure at
the same speed)."""

from __future__ import annotations

import pytest

import mps
from harness import spawn


def test_workers_get_the_callers_environment_and_their_ranks_additions(monkeypatch):
    monkeypatch.setenv("TERAPIPE_SPAWN_PROBE", "set at the call")
    names = ["TERAPIPE_SPAWN_PROBE", mps.SHARE_VARIABLE]
    seen = spawn(2, "harness.runs.workers:environment_of", names,
                 rank_environ={1: {mps.SHARE_VARIABLE: "50"}})
    assert seen[0] == {"TERAPIPE_SPAWN_PROBE": "set at the call", mps.SHARE_VARIABLE: None}
    assert seen[1] == {"TERAPIPE_SPAWN_PROBE": "set at the call", mps.SHARE_VARIABLE: "50"}


def test_stage_environ_gives_each_stage_its_share():
    assert mps.stage_environ(4) == {r: {mps.SHARE_VARIABLE: "25"} for r in range(4)}
    assert mps.stage_environ(2, ranks=1) == {0: {mps.SHARE_VARIABLE: "50"}}
    assert mps.stage_environ(3) == {r: {mps.SHARE_VARIABLE: "33"} for r in range(3)}


def test_enter_stage_refuses_a_process_started_without_an_mps_daemon(monkeypatch):
    monkeypatch.delenv(mps.PIPE_VARIABLE, raising=False)
    monkeypatch.setenv(mps.SHARE_VARIABLE, "50")
    with pytest.raises(RuntimeError, match=r"stage 0 of 2: no MPS daemon \(CUDA_MPS_PIPE_DIRECTORY "
                                           r"is not set\): start the stage processes inside "
                                           r"`with mps\.MpsDaemon\(\):`"):
        mps.enter_stage(0, 2)


def test_enter_stage_refuses_a_process_started_without_its_share(monkeypatch):
    monkeypatch.setenv(mps.PIPE_VARIABLE, "/tmp/terapipe-mps-test/pipe")
    monkeypatch.delenv(mps.SHARE_VARIABLE, raising=False)
    with pytest.raises(RuntimeError, match=r"stage 1 of 2: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is "
                                           r"None, not '50': start the stage processes with "
                                           r"spawn\(\.\.\., rank_environ=mps\.stage_environ\(2\)\)"):
        mps.enter_stage(1, 2)
    monkeypatch.setenv(mps.SHARE_VARIABLE, "25")  # another stage count's share
    with pytest.raises(RuntimeError, match="is '25', not '50'"):
        mps.enter_stage(0, 2)


def test_the_gpu_pipeline_benchmark_starts_stages_with_their_shares():
    import bench_gpu_pipeline

    assert bench_gpu_pipeline.sm_shares("cuda", 4) == mps.stage_environ(4)
    assert bench_gpu_pipeline.sm_shares("cuda", 4, ranks=1) == {0: {mps.SHARE_VARIABLE: "25"}}
    assert bench_gpu_pipeline.sm_shares("cpu", 4) is None
