"""What bench_gpu_pipeline.py does around its timed runs: the simulator's link from the measured
transfers, and the reruns of a case whose graphed rows fail (both before any GPU time is spent)."""

import os
import sys

import pytest

from harness import WorkerError


def test_the_gpu_pipeline_link_goes_through_its_two_measurements():
    """bench_gpu_pipeline prices transfers with a Link through the host-staged communicator's
    measured times at two sizes (an assumed bandwidth can be 40x off: host staging runs at
    about 2.6 GB/s); never a negative latency, and a flat measurement priced by bytes alone."""
    import bench_gpu_pipeline

    link = bench_gpu_pipeline.link_through([(1000, 0.002), (9000, 0.006)])
    assert link.bandwidth == pytest.approx(2e6) and link.latency == pytest.approx(0.0015)
    assert float(link.time(1000)) == pytest.approx(0.002) and float(link.time(9000)) == pytest.approx(0.006)
    flat = bench_gpu_pipeline.link_through([(1000, 0.004), (9000, 0.004)])
    assert flat.latency == 0.0 and flat.bandwidth == pytest.approx(9000 / 0.004)
    steep = bench_gpu_pipeline.link_through([(1000, 0.0001), (9000, 0.009)])  # would fit below 0
    assert steep.latency == 0.0 and steep.bandwidth == pytest.approx(8000 / 0.0089)


def test_a_case_whose_graphs_run_out_of_memory_keeps_its_eager_rows(monkeypatch):
    """bench_gpu_pipeline.timed: a failure with Megatron's graphs reruns without them; a second
    failure with TeraPipe's graphed rows reruns eager on both sides, and both errors are kept."""
    import bench_gpu_pipeline
    from pipeline_runs import SpeedCase

    from megatron_terapipe import TeraPipePlan

    calls = []

    def fake_spawn(stages, target, speed, device, **kwargs):
        calls.append(dict(speed.plans))
        if speed.graphed:
            raise WorkerError(f"{stages} of {stages} ranks failed\ntorch.OutOfMemoryError: try {len(calls)}",
                              {}, [])
        return [{label: [0.1] for label in speed.plans}]

    monkeypatch.setattr(bench_gpu_pipeline, "spawn", fake_spawn)
    dp = TeraPipePlan([2048])
    plans = {"megatron_1f1b": None, "terapipe_dp": dp, "megatron_1f1b+graphs": None,
             "terapipe_dp+graphs": dp}
    speed = SpeedCase("pp4_seq2048_M4", None, 4, 128, 1, plans, mps=True,
                      graphed=("megatron_1f1b+graphs", "terapipe_dp+graphs"))
    case = bench_gpu_pipeline.GpuCase(4, 2048, 4)
    speed, per_rank, error = bench_gpu_pipeline.timed(speed, case, "cuda")
    assert [sorted(c) for c in calls] == [sorted(plans), ["megatron_1f1b", "terapipe_dp", "terapipe_dp+graphs"],
                                          ["megatron_1f1b", "terapipe_dp"]]
    assert speed.graphed == () and sorted(per_rank[0]) == ["megatron_1f1b", "terapipe_dp"]
    assert error == "torch.OutOfMemoryError: try 1; torch.OutOfMemoryError: try 2"

    def failing_spawn(*args, **kwargs):
        raise WorkerError("eager failed", {}, [])

    monkeypatch.setattr(bench_gpu_pipeline, "spawn", failing_spawn)
    with pytest.raises(WorkerError, match="eager failed"):  # nothing graphed left to drop
        bench_gpu_pipeline.timed(speed, case, "cuda")


def test_the_resimulation_prices_transfers_from_the_runs_own_measurement():
    """resimulate_gpu_pipeline.run_link: a run's two-point fit where it made one, else its one
    measured size as bandwidth with no latency (bf16 on a GPU unless the run said --fp32)."""
    import resimulate_gpu_pipeline as resim

    one = {"device": "cuda", "provenance": {"command": ["bench_gpu_pipeline.py"]},
           "transfer_one_way_s": {"shape": [2048, 1, 4096], "seconds": 0.008}}
    link, how = resim.run_link(one)
    assert link.latency == 0.0 and link.bandwidth == pytest.approx(2 * 2048 * 4096 / 0.008)
    assert "16777216 bytes" in how
    fp32 = dict(one, provenance={"command": ["bench_gpu_pipeline.py", "--fp32"]})
    assert resim.run_link(fp32)[0].bandwidth == pytest.approx(4 * 2048 * 4096 / 0.008)
    fitted = dict(one, link={"bandwidth_bytes_per_s": 3e9, "latency_s": 2e-4})
    link, how = resim.run_link(fitted)
    assert (link.bandwidth, link.latency, how) == (3e9, 2e-4, "two-point fit")


def test_device_timed_profiles_are_their_own_cache_and_refused_without_cuda(tmp_path, capsys):
    """--profile-timing device (plans on the GPU's own time, what graphed cells cost): its own
    cache file, never a wall-timed profile reused for it, and on a machine without CUDA an
    error naming the option before anything is measured or written."""
    import subprocess

    import torch

    import bench_gpu_pipeline
    from pipeline_plans import profile_cost_model

    case = bench_gpu_pipeline.SUITES["smoke"][0]
    wall, device = case.profile_cache("f", "cuda"), case.profile_cache("f", "cuda", "device")
    assert wall.endswith("_s256.json") and device.endswith("_s256_device.json")
    cache = str(tmp_path / "profile.json")
    model = case.model(bf16=False)
    profile_cost_model(model, 64, case.layers_per_stage, "cpu", cache)  # wall-timed, cached
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--timing device measures GPU time"):
            profile_cost_model(model, 64, case.layers_per_stage, "cpu", cache, timing="device")
        assert "was timed 'wall', not 'device': measuring again" in capsys.readouterr().out
        out = tmp_path / "never"
        script = os.path.join(os.path.dirname(bench_gpu_pipeline.__file__), "bench_gpu_pipeline.py")
        done = subprocess.run([sys.executable, script, "--cases", "smoke", "--profile-timing", "device",
                               "--out", str(out)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "--profile-timing device measures GPU time" in done.stderr
        assert not out.exists()
