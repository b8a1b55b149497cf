"""What the benchmarks' results files say about themselves, and what their rows compare.

- benchmarks/provenance.py: the date-time, the commit and whether the code that ran differed
  from it (a results file is data, not code), the machine, the command; `--stamp`.
- bench_schedules --repeats: every suite run's numbers and the median per row.
- bench_gpu_pipeline --cuda-graphs: a row's ratio is to the Megatron row with the same graphs,
  never from a graphed row to an eager one, also when Megatron's own graphs fail.
- bench_stage / bench_host_ops: Megatron's row runs TeraPipe's slice-aware spec, which outside
  a TeraPipe cell is ordinary causal attention (the local spec's losses and gradients).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from datetime import datetime

import pytest
import torch

import provenance
from harness import GLOO_AND_NCCL, WorkerError, release_model_parallel, spawn


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A git checkout with code, a results file and a committed state; provenance reads it."""
    for path in ("megatron_terapipe/plan.py", "benchmarks/bench.py", "benchmarks/results/r.json",
                 "docs/notes.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "code")
    monkeypatch.setattr(provenance, "ROOT", str(tmp_path))
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    return tmp_path


def test_provenance_names_the_time_the_commit_the_machine_and_the_command(checkout):
    origin = provenance.provenance(["python", "benchmarks/bench.py", "--quick"])
    assert datetime.fromisoformat(origin["measured"]).tzinfo is not None
    assert origin["commit"] == _git(checkout, "rev-parse", "HEAD")
    assert (origin["commit_source"], origin["dirty"], origin["dirty_paths"]) == ("git", False, [])
    machine = origin["machine"]
    assert machine["logical_cores"] == os.cpu_count()
    assert machine["affinity"] == sorted(os.sched_getaffinity(0))
    assert machine["torch"] == torch.__version__ and machine["gpu"] is None
    assert machine["cpu"] and machine["python"] and machine["platform"]
    assert origin["command"] == ["python", "benchmarks/bench.py", "--quick"]


def test_dirty_means_code_changed_or_new_not_results_or_docs(checkout):
    (checkout / "benchmarks/results/r.json").write_text("2\n")  # a rerun's results
    (checkout / "benchmarks/results/new.json").write_text("2\n")
    (checkout / "docs/notes.md").write_text("2\n")
    assert provenance.code_state()["dirty"] is False
    (checkout / "megatron_terapipe/plan.py").write_text("2\n")
    _git(checkout, "add", "megatron_terapipe/plan.py")  # staged counts too
    (checkout / "benchmarks/bench.py").write_text("2\n")
    # a new benchmark the commit does not hold (else a results file names a commit without
    # the script that wrote it)
    (checkout / "benchmarks/bench_new.py").write_text("untracked\n")
    state = provenance.code_state()
    assert state["dirty"] is True
    assert state["dirty_paths"] == ["benchmarks/bench.py", "benchmarks/bench_new.py",
                                    "megatron_terapipe/plan.py"]


def test_outside_git_the_commit_comes_from_the_environment_or_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "ROOT", str(tmp_path))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    state = provenance.code_state()
    assert state["commit"] is None and state["dirty"] is None
    assert provenance.COMMIT_VARIABLE in state["commit_source"]
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "abc123")
    assert provenance.code_state()["commit"] == "abc123"
    assert provenance.code_state()["commit_source"] == provenance.COMMIT_VARIABLE


def test_the_environment_names_the_commit_over_stale_git_metadata(checkout, monkeypatch):
    # A device machine's copy of the tree carried an older .git: the caller's commit wins.
    head = _git(checkout, "rev-parse", "HEAD")
    (checkout / "benchmarks/bench.py").write_text("2\n")
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "abc123")
    state = provenance.code_state()
    assert (state["commit"], state["commit_source"]) == ("abc123", provenance.COMMIT_VARIABLE)
    assert (state["git_commit"], state["dirty_paths"]) == (head, ["benchmarks/bench.py"])
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, head)  # the same commit: git's own view
    assert provenance.code_state()["commit_source"] == "git"


def test_stamp_puts_the_provenance_first_and_keeps_the_data(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": "x", "fit": {"a": 1}}))
    provenance.main(["--stamp", str(path), "--", "python3", "-m", "tool", "--out", str(path)])
    data = json.loads(path.read_text())
    assert list(data) == ["provenance", "format", "fit"] and data["fit"] == {"a": 1}
    assert data["provenance"]["command"] == ["python3", "-m", "tool", "--out", str(path)]
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="only an object"):
        provenance.main(["--stamp", str(path), "--", "tool"])


# ---------------------------------------------------------------------------------------------
def _speed_row(config, measured, speedup, slices=None, busy=None):
    return {"case": "seq2048_M1", "config": config, "num_microbatches": 1,
            "slices": slices, "order": None if slices is None else "1f1b",
            "defer_wgrad": None if slices is None else True, "wgrad_points": None if slices is None else [],
            "measured_s": measured, "speedup_vs_megatron": speedup, "predicted_s": 1.0,
            "predicted_dedicated_s": 1.0, "fidelity_error": 1.0 / measured - 1, "stage_busy_s": busy}


def test_bench_schedules_repeats_keep_every_run_and_the_median_per_row():
    import bench_schedules

    ratios = [1.70, 1.74, 1.71]
    runs = [{"parallel_capacity": 1.9, "speed": [
        _speed_row("megatron_1f1b", 2.5, 1.0),
        _speed_row("terapipe_dp", 2.5 / r, r, slices=[[256] * 8], busy=[1.0 + i, 2.0])]}
        for i, r in enumerate(ratios)]
    runs[2]["speed"][1]["slices"] = [[512] * 4]  # the third run chose another plan
    rows = bench_schedules.median_rows(runs)
    dp = next(r for r in rows if r["config"] == "terapipe_dp")
    assert dp["speedup_vs_megatron_per_run"] == ratios
    assert dp["speedup_vs_megatron"] == 1.71  # the median, not the best (1.74)
    assert dp["measured_s"] == pytest.approx(2.5 / 1.71)
    assert dp["stage_busy_s"] == [2.0, 2.0]
    assert dp["same_plan_every_run"] is False
    assert rows[0]["same_plan_every_run"] is True
    with pytest.raises(SystemExit):
        bench_schedules.parse_args(["--repeats", "0"])
    args = bench_schedules.parse_args(["--repeats", "3", "--rounds", "5"])
    assert (args.repeats, args.rounds) == (3, 5)


# ---------------------------------------------------------------------------------------------
def _pipeline_args(**kw):
    return argparse.Namespace(**{"cuda_graphs": True, "megatron_graphs": "local", **kw})


def test_graphed_rows_on_both_sides_only_where_megatron_can_graph():
    import bench_gpu_pipeline

    plans = {"megatron_1f1b": None, "terapipe_dp": "dp", "terapipe_uniform": "uniform"}
    labelled, graphed = bench_gpu_pipeline.labelled_plans(plans, _pipeline_args(), "cuda")
    assert set(graphed) == {"megatron_1f1b+graphs", "terapipe_dp+graphs", "terapipe_uniform+graphs"}
    assert labelled["megatron_1f1b+graphs"] is None and labelled["terapipe_dp+graphs"] == "dp"
    assert set(plans) <= set(labelled)  # the eager rows stay
    for device, args in (("cpu", _pipeline_args()), ("cuda", _pipeline_args(megatron_graphs="none"))):
        _, graphed = bench_gpu_pipeline.labelled_plans(plans, args, device)
        assert set(graphed) == {"terapipe_dp+graphs", "terapipe_uniform+graphs"}
    assert bench_gpu_pipeline.labelled_plans(plans, _pipeline_args(cuda_graphs=False), "cuda") == (plans, ())


def test_a_w_placed_row_where_the_planner_places_w_faster():
    """bench_gpu_pipeline adds the DP plan with its W actions placed (plan_wgrad) as its own
    row, predicted at plan_wgrad's time; none where the DP defers no W or placing gains
    nothing."""
    import bench_gpu_pipeline
    from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset
    from megatron_terapipe.planner.evaluate.simulator import plan_time
    from megatron_terapipe.plan import TeraPipePlan

    cost = AnalyticCostModel(model_preset("gpt3-1b"), hardware_preset("a100"),
                             layers_per_stage=6, tensor_parallel=2)
    case = bench_gpu_pipeline.GpuCase(4, 2048, 4)
    dp = TeraPipePlan([512] * 4)
    added = bench_gpu_pipeline.w_placed_plans({"terapipe_dp": dp}, cost, case)
    placed = added["terapipe_dp_w_placed"]
    assert placed.seq_slices == dp.seq_slices and placed.wgrad_after
    assert placed.predicted_time == plan_time(placed, cost, 4, 4, 1) < plan_time(dp, cost, 4, 4, 1)
    from dataclasses import replace
    assert bench_gpu_pipeline.w_placed_plans(
        {"terapipe_dp": replace(dp, defer_wgrad=False)}, cost, case) == {}
    # one stage: nothing to wait for, so no place beats the default
    single = bench_gpu_pipeline.GpuCase(1, 2048, 1)
    assert bench_gpu_pipeline.w_placed_plans({"terapipe_dp": dp}, cost, single) == {}


def _pipeline_row(config, graphs, runs):
    return {"config": config, "order": None if config.startswith("megatron") else "1f1b",
            "graphs": graphs, "runs_s": runs, "measured_s": runs[0], "predicted_s": runs[0]}


def test_a_ratio_is_only_ever_to_the_megatron_row_with_the_same_graphs():
    import bench_gpu_pipeline

    rows = [_pipeline_row("megatron_1f1b", "none", [4.0, 4.0]),
            _pipeline_row("terapipe_dp", "none", [2.0, 2.0]),
            _pipeline_row("megatron_1f1b+graphs", "megatron", [3.0, 3.0]),
            _pipeline_row("terapipe_dp+graphs", "terapipe", [1.0, 1.0])]
    bench_gpu_pipeline.with_ratios(rows)
    ratio = {r["config"]: (r["baseline"], r["speedup_vs_megatron"]) for r in rows}
    assert ratio["terapipe_dp"] == ("megatron_1f1b", 2.0)
    assert ratio["terapipe_dp+graphs"] == ("megatron_1f1b+graphs", 3.0)  # not 4.0: eager Megatron
    without = [r for r in rows if r["config"] != "megatron_1f1b+graphs"]
    bench_gpu_pipeline.with_ratios(without)
    graphed = without[-1]
    assert graphed["speedup_vs_megatron"] is None and graphed["baseline"] is None
    assert "no Megatron row with graphs" in graphed["no_ratio"]


def test_beside_it_each_row_has_a_ratio_to_the_fastest_megatron_row_of_each_round():
    import bench_gpu_pipeline

    # round 0: eager Megatron is the faster (3.0 < 3.5); round 1: the graphed one (2.5 < 4.0)
    rows = [_pipeline_row("megatron_1f1b", "none", [3.0, 4.0]),
            _pipeline_row("megatron_1f1b+graphs", "megatron", [3.5, 2.5]),
            _pipeline_row("terapipe_dp+graphs", "terapipe", [1.5, 1.25])]
    bench_gpu_pipeline.with_ratios(rows)
    best = {r["config"]: r["speedup_vs_fastest_megatron"] for r in rows}
    assert best["terapipe_dp+graphs"] == pytest.approx(2.0)  # 3.0 / 1.5 and 2.5 / 1.25
    assert rows[2]["speedup_vs_megatron"] == pytest.approx((3.5 / 1.5 + 2.5 / 1.25) / 2)
    assert best["megatron_1f1b"] == pytest.approx((1.0 + 2.5 / 4.0) / 2)
    no_megatron = [_pipeline_row("terapipe_dp", "none", [1.0])]
    bench_gpu_pipeline.with_ratios(no_megatron)
    assert no_megatron[0]["speedup_vs_fastest_megatron"] is None


def test_a_failing_megatron_capture_is_recorded_and_the_case_reruns_without_it(monkeypatch):
    import bench_gpu_pipeline
    from pipeline_runs import SpeedCase

    calls = []

    def fake_spawn(world_size, target, speed, device, timeout, backend, rank_environ):
        assert backend == GLOO_AND_NCCL  # NCCL for the CUDA tensors of the loss cells
        # each stage's SM share in its environment from the start (tests/tooling/harness/test_spawn.py)
        assert rank_environ == {r: {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"} for r in range(2)}
        calls.append(dict(speed.plans))
        if "megatron_1f1b+graphs" in speed.plans:
            raise WorkerError("1 of 2 ranks failed\nTraceback ...\nAssertionError: capture failed",
                              {0: "..."}, [])
        return [{"ran": list(speed.plans)}] * world_size

    monkeypatch.setattr(bench_gpu_pipeline, "spawn", fake_spawn)
    case = bench_gpu_pipeline.GpuCase(2, 256, 1)
    speed = SpeedCase("c", None, 1, 64, 2, {"megatron_1f1b": None, "terapipe_dp": "dp",
                                           "megatron_1f1b+graphs": None, "terapipe_dp+graphs": "dp"},
                      graphed=("megatron_1f1b+graphs", "terapipe_dp+graphs"))
    speed, per_rank, error = bench_gpu_pipeline.timed(speed, case, "cuda")
    assert error == "AssertionError: capture failed" and len(calls) == 2
    assert "megatron_1f1b+graphs" not in speed.plans and speed.graphed == ("terapipe_dp+graphs",)
    assert per_rank[0]["ran"] == ["megatron_1f1b", "terapipe_dp", "terapipe_dp+graphs"]


def test_megatron_graphed_stage_refused_without_cuda():
    from pipeline_runs import _megatron_graphed_model

    with pytest.raises(ValueError, match="needs CUDA"):
        _megatron_graphed_model(None, 2, None, "cpu")


# ---------------------------------------------------------------------------------------------
def run_megatron_on_both_specs(rank: int, world_size: int) -> dict:
    """bench_stage's models: Megatron's no-pipelining on the slice-aware spec and on its local
    spec, same weights and batch: losses and gradients."""
    import bench_stage
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    import megatron_terapipe as mt

    mt.enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, 1)
    args = bench_stage.parse_args(["--num-layers", "2", "--hidden-size", "32", "--seq-length", "64",
                                   "--vocab-size", "64", "--megatron-local-spec"])
    models = bench_stage.build_models(args)
    batch = bench_stage.make_batch(args)
    out = {}
    for side in ("megatron", "megatron_local"):
        model = models[side]
        model.zero_grad(set_to_none=True)
        losses = forward_backward_no_pipelining(
            forward_step_func=bench_stage.forward_step, data_iterator=iter([batch]), model=[model],
            num_microbatches=1, seq_length=args.seq_length, micro_batch_size=1)
        out[side] = {"loss": float(losses[0]["lm loss"][0]),
                     "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    out["attention"] = {side: type(m.decoder.layers[0].self_attention.core_attention).__name__
                        for side, m in models.items()}
    release_model_parallel()
    return out


def test_megatrons_row_on_the_slice_aware_spec_is_ordinary_causal_attention():
    out = spawn(1, "test_benchmark_honesty:run_megatron_on_both_specs", timeout=300)[0]
    assert out["attention"] == {"terapipe": "SliceAttention", "megatron": "SliceAttention",
                                "megatron_local": "DotProductAttention"}
    sdpa, local = out["megatron"], out["megatron_local"]
    assert sdpa["loss"] == pytest.approx(local["loss"], rel=1e-6)
    assert sdpa["grads"].keys() == local["grads"].keys()
    for name, grad in local["grads"].items():
        torch.testing.assert_close(sdpa["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def bf16_parameter_dtypes(rank: int, world_size: int) -> dict:
    """The dtypes of every parameter of bench_stage's bf16 models and of a bf16 pipeline stage."""
    import bench_stage
    from megatron.core import parallel_state

    import megatron_terapipe as mt
    from harness import TinyGPT, build_stage_model, in_precision

    mt.enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, 1)
    args = bench_stage.parse_args(["--num-layers", "2", "--hidden-size", "32", "--seq-length", "64",
                                   "--vocab-size", "64", "--bf16"])
    models = bench_stage.build_models(args)
    config, stage = build_stage_model(TinyGPT(params_dtype=torch.bfloat16, bf16=True), 1, 1)
    models["pipeline_stage"] = in_precision(config, stage)
    out = {side: {str(p.dtype) for p in m.parameters()} for side, m in models.items()}
    release_model_parallel()
    return out


def test_bf16_benchmark_models_hold_every_parameter_in_bf16():
    # Megatron's torch norms ignore params_dtype: without Float16Module their weights stay
    # float32, which CUDA's layer_norm refuses on bf16 input.
    out = spawn(1, "test_benchmark_honesty:bf16_parameter_dtypes", timeout=300)[0]
    assert out == {"terapipe": {"torch.bfloat16"}, "megatron": {"torch.bfloat16"},
                   "pipeline_stage": {"torch.bfloat16"}}


def test_a_rows_added_peak_is_over_what_the_stage_held_when_its_run_started(monkeypatch):
    # Earlier rows' models, pools and graphs stay allocated in the stage process: the absolute
    # peak counts them, the added peak does not
    import types

    import pipeline_runs
    import torch

    allocated = {"now": 5.0, "peak": 0.0}

    def run(label):
        allocated["peak"] = max(allocated["peak"], allocated["now"] + 3.0)  # the run's own 3
        allocated["now"] += 1.0  # and 1 it keeps (a pool)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda: allocated.update(peak=allocated["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocated["peak"])
    model = types.SimpleNamespace(zero_grad=lambda set_to_none: None)
    times = {}
    case = types.SimpleNamespace(graphed=("b",))
    pipeline_runs._warm_up("a", run, {"a": model}, case, "cuda", times)
    assert times["peak:a"] == [8.0] and times["added:a"] == [3.0]
    pipeline_runs._warm_up("b", run, {"b": model}, case, "cuda", times)  # graphed: warmed twice
    assert times["peak:b"] == [10.0] and times["added:b"] == [3.0]


def test_virtual_rows_through_the_host_staged_communicator_on_cpu(tmp_path):
    """bench_gpu_virtual --smoke on CPU: every row moves its activations as the GPU run does
    under MPS (Megatron's 1F1B and interleaved 1F1B and TeraPipe on one chunk through the
    host-staged communicator, TeraPipe on 2 chunks through its host-staged torch transport),
    and computes Megatron 1F1B's losses."""
    import bench_gpu_virtual

    assert bench_gpu_virtual.main(["--smoke", "--rounds", "1", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "virtual_gpu_smoke.json") as f:
        result = json.load(f)
    rows = {r["config"]: r for r in result["speed"]}
    assert {"megatron_1f1b", "megatron_interleaved_v2", "terapipe_v1", "terapipe_v2"} <= set(rows)
    for r in rows.values():
        staged = (r["torch_transport_received"] if r["config"].startswith("terapipe_v2")
                  else r["host_staged_messages"])  # TeraPipe on chunks: its host-staged transport
        assert all(n > 0 for n in staged), r["config"]
        assert r["loss_rel_diff_vs_megatron_1f1b"] <= 1e-6, r["config"]
    assert result["machine"]["device"] == "cpu" and result["provenance"]["command"]

