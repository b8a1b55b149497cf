"""Megatron-LM flags: parsing, validation errors naming the flag, plans from flags, the plan
every rank gets, and the on-disk profile cache."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron_terapipe import TeraPipePlan
from megatron_terapipe.megatron.platform import router_versions
from megatron_terapipe.megatron.args.flags import add_terapipe_args, combine_extra_args
from megatron_terapipe.megatron.args.plan_provider import ArgsPlanProvider
from megatron_terapipe.megatron.args.startup_log import PlanReport
from megatron_terapipe.megatron.args.profile_cache import profile_cache_key, profile_cache_path
from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from megatron_terapipe.megatron.wiring import setup_from_args
from harness import spawn
from harness.inputs.flags import MOE_LOSSES, parse, plan_and_report, run_settings


def test_defaults_keep_megatron_schedule():
    args = parse([])
    assert args.pipeline_schedule == "1f1b"
    assert args.terapipe_order == "1f1b"
    assert args.terapipe_slices is None and args.terapipe_num_slices is None
    assert args.terapipe_cost_model == "analytic" and args.terapipe_hardware == "auto"
    assert args.terapipe_granularity == 8 and args.terapipe_trace is None
    validate_terapipe_args(args)  # nothing to check


def test_flags_parse():
    args = parse(["--pipeline-schedule", "terapipe", "--terapipe-order", "gpipe",
                  "--terapipe-slices", "32", "16", "16", "--terapipe-cost-model", "profile",
                  "--terapipe-granularity", "16", "--terapipe-trace", "t.json",
                  "--terapipe-hardware", "h100", "--terapipe-cache-dir", "/tmp/x"])
    assert args.pipeline_schedule == "terapipe" and args.terapipe_order == "gpipe"
    assert args.terapipe_slices == [32, 16, 16] and args.terapipe_granularity == 16
    assert args.terapipe_cost_model == "profile" and args.terapipe_trace == "t.json"
    validate_terapipe_args(args)


def test_slices_and_num_slices_are_exclusive_in_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse(["--terapipe-slices", "32", "32", "--terapipe-num-slices", "2"])
    assert "--terapipe-num-slices" in capsys.readouterr().err


def test_combine_extra_args_with_the_scripts_provider():
    calls = []

    def script_provider(parser):
        calls.append("script")
        parser.add_argument("--my-flag", type=int, default=3)
        return parser

    provider = combine_extra_args(script_provider, None, add_terapipe_args, add_terapipe_args)
    parser = provider(argparse.ArgumentParser())
    args = parser.parse_args(["--my-flag", "5", "--pipeline-schedule", "terapipe"])
    assert calls == ["script"] and args.my_flag == 5 and args.pipeline_schedule == "terapipe"
    # a provider that returns None (mutates in place) is fine too
    parser = combine_extra_args(lambda p: None, add_terapipe_args)(argparse.ArgumentParser())
    assert parser.parse_args([]).pipeline_schedule == "1f1b"


@pytest.mark.parametrize("argv, megatron, flag", [
    (["--terapipe-slices", "32", "16"], {}, "--terapipe-slices 32 16 sum to 48 tokens but --seq-length is 64"),
    (["--terapipe-slices", "80", "-16"], {}, "--terapipe-slices must be positive"),
    (["--terapipe-num-slices", "0"], {}, "--terapipe-num-slices must be a positive"),
    (["--terapipe-num-slices", "9"], {}, "--terapipe-num-slices 9 is more than --seq-length 64"),
    (["--terapipe-granularity", "0"], {}, "--terapipe-granularity must be a positive"),
    (["--terapipe-granularity", "24"], {}, "--seq-length 64 is not a multiple of --terapipe-granularity 24"),
    (["--terapipe-slices", "30", "34"], dict(tensor_model_parallel_size=4, sequence_parallel=True),
     "not multiples of --tensor-model-parallel-size 4"),
    (["--terapipe-cost-model", "/no/such/profile.json"], {}, "--terapipe-cost-model '/no/such/profile.json'"),
    (["--terapipe-trace", "/no/such/dir/t.json"], {}, "--terapipe-trace /no/such/dir/t.json"),
    (["--terapipe-profile-points", "1"], {}, "--terapipe-profile-points must be at least 2"),
    ([], dict(context_parallel_size=2), "--context-parallel-size"),
    ([], dict(virtual_pipeline_model_parallel_size=3), "3 virtual pipeline stages per rank do not"),
    ([], dict(num_experts=8, moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
    ([], dict(num_experts=8, moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor 1.0"),
    ([], dict(mtp_num_layers=1), "--mtp-num-layers"),
    ([], dict(use_legacy_models=True), "--use-legacy-models"),
    ([], dict(decoder_seq_length=32), "--decoder-seq-length"),
    ([], dict(tensor_model_parallel_size=2, reset_attention_mask=True), "--reset-attention-mask"),
    ([], dict(seq_length=None), "--seq-length"),
])
def test_bad_configurations_name_the_flag(argv, megatron, flag):
    args = parse(["--pipeline-schedule", "terapipe", *argv], **megatron)
    with pytest.raises(TeraPipeArgumentError) as info:
        validate_terapipe_args(args)
    assert flag in str(info.value)


def test_dropless_moe_is_accepted():
    """Top-k routing without dropping or Sinkhorn is token-wise; the router losses are made
    exact (model/moe_router_losses.py) on this megatron-core line."""
    for extra in ({}, dict(moe_aux_loss_coeff=0.0), dict(moe_router_enable_expert_bias=True),
                  dict(moe_aux_loss_coeff=0.5, moe_router_load_balancing_type="none"),
                  *(MOE_LOSSES if router_versions.line_problem() is None else [])):
        validate_terapipe_args(parse(["--pipeline-schedule", "terapipe"], num_experts=8, **extra))


def test_both_slice_flags_rejected_when_set_programmatically():
    args = parse(["--pipeline-schedule", "terapipe"])
    args.terapipe_slices, args.terapipe_num_slices = [32, 32], 2
    with pytest.raises(TeraPipeArgumentError, match="mutually exclusive"):
        validate_terapipe_args(args)


def test_slices_without_terapipe_schedule_rejected():
    with pytest.raises(TeraPipeArgumentError, match="needs --pipeline-schedule terapipe"):
        validate_terapipe_args(parse(["--terapipe-num-slices", "4"]))


def test_explicit_uniform_and_planned_slices():
    plan = plan_from_args(parse(["--pipeline-schedule", "terapipe", "--terapipe-slices", "40", "24"]), 64, 2)
    assert plan.token_slices == ((40, 24),) and plan.order == "1f1b"
    plan = plan_from_args(parse(["--pipeline-schedule", "terapipe", "--terapipe-num-slices", "3",
                                 "--terapipe-order", "gpipe"]), 64, 2)
    assert plan.token_slices == ((24, 24, 16),) and plan.order == "gpipe"
    assert all(t % 8 == 0 for t in plan.token_slices[0])
    # no slices: the exact DP slicer on the analytic model of the flags' model shape
    args = parse(["--pipeline-schedule", "terapipe", "--terapipe-hardware", "v100",
                  "--terapipe-granularity", "64"], seq_length=2048, num_layers=24, hidden_size=2048,
                 num_attention_heads=16, pipeline_model_parallel_size=4, global_batch_size=8,
                 micro_batch_size=1, world_size=4)
    plan, report = plan_and_report(args, 2048, 1)
    cut = sum((plan.token_slices[0], *(ts for _, ts in plan.edge_slices)), ())  # DP's, edges'
    assert plan.seq_length == 2048 and len(cut) > 1 and all(t % 64 == 0 for t in cut)
    assert plan.predicted_time == pytest.approx(report.iteration_time)
    assert report.iteration_time < report.baseline_time  # token slices shrink the bubble
    assert report.bubble < report.baseline_bubble
    lines = report.lines(plan)
    assert lines[0].startswith("> terapipe plan for seq_length 2048, micro_batch_size 1, 8 microbatches, 4 pipeline stages")
    assert any("predicted iteration" in line and "1F1B without token slices" in line for line in lines)
    assert any("pipeline bubble" in line for line in lines)


def test_defer_wgrad_flag():
    base = ["--pipeline-schedule", "terapipe", "--terapipe-num-slices", "4",
            "--terapipe-hardware", "a100"]
    big = dict(seq_length=2048, num_layers=24, hidden_size=2048, num_attention_heads=16,
               pipeline_model_parallel_size=4, global_batch_size=1, micro_batch_size=1,
               world_size=4)

    def plan(*extra):
        p, report = plan_and_report(parse(base + list(extra), **big), 2048, 1)
        return p, report

    on, report_on = plan("--terapipe-defer-wgrad", "on")
    off, report_off = plan("--terapipe-defer-wgrad", "off")
    auto, _ = plan("--terapipe-defer-wgrad", "auto")
    default, _ = plan()
    assert on.defer_wgrad and not off.defer_wgrad
    assert default == on  # deferral is the default
    assert on.token_slices == off.token_slices == auto.token_slices  # the flag only adds W
    # auto: deferred exactly when the simulation finds it at least 1% faster
    assert auto.defer_wgrad == (report_on.iteration_time < 0.99 * report_off.iteration_time)
    assert any("weight gradients .......... deferred" in line for line in report_on.lines(on))
    with pytest.raises(SystemExit):
        parse(["--terapipe-defer-wgrad", "maybe"])


def test_plan_log_names_early_w_actions():
    plan = TeraPipePlan([8, 8, 8, 8], defer_wgrad=True, wgrad_points=[[3, 1]])
    report = PlanReport(32, 1, 1, 2, "DP slicer", "analytic")
    assert (">   weight gradients .......... deferred: one W action per sequence; early W: "
            "stage 0 after slices [1, 3]") in report.lines(plan)


def test_plan_log_draws_one_microbatch_to_scale():
    plan = TeraPipePlan([[512, 256, 256], [1024]], batch_slices=[2, 2])
    lines = PlanReport(1024, 4, 1, 2, "DP slicer", "analytic").lines(plan)
    i = lines.index(">   one microbatch to scale:")
    rows = lines[i + 1:i + 3]
    assert rows[0].startswith(">     2 rows |")
    assert [s.strip() for s in rows[0].split("|")[1:-1]] == ["512", "256", "256"]
    assert [s.strip() for s in rows[1].split("|")[1:-1]] == ["1024"]
    assert len(rows[0]) == len(rows[1]) < 80
    assert lines[i + 3].startswith(">   order")


def test_provider_plans_once_per_shape(capsys):
    provider = ArgsPlanProvider.from_args(parse(["--pipeline-schedule", "terapipe", "--terapipe-num-slices", "4"]))
    first = provider.plan_for(64, 2)
    assert provider.plan_for(64, 2) is first
    assert provider.plan_for(32, 2).token_slices == ((8, 8, 8, 8),)
    out = capsys.readouterr().out
    assert out.count("> terapipe plan for seq_length 64") == 1 and "seq_length 32" in out


def test_profile_cost_model_from_a_file_must_match_the_model(tmp_path):
    from megatron_terapipe.planner import LayerTimeFit, fit_layer_times
    from megatron_terapipe.planner.profile.time_samples import LayerMeasurements

    def fake_fit(hidden):
        cells = [(b, length, c) for b in (1, 2) for length in (8, 16, 32, 64) for c in (0, 16, 32)]
        m = LayerMeasurements(*zip(*cells), [1e-4 * b * (l + 0.01 * c) for b, l, c in cells],
                              [2e-4 * b * (l + 0.01 * c) for b, l, c in cells],
                              metadata={"model": {"num_layers": 1, "hidden_size": hidden,
                                                  "num_attention_heads": 4, "ffn_hidden_size": 4 * hidden,
                                                  "num_query_groups": 4, "gated_linear_unit": False},
                                        "tensor_parallel": 1})
        return fit_layer_times(m, holdout=0)

    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    fake_fit(64).save(good)
    fake_fit(128).save(bad)
    assert isinstance(LayerTimeFit.load(good), LayerTimeFit)
    plan = plan_from_args(parse(["--pipeline-schedule", "terapipe", "--terapipe-cost-model", str(good)]), 64, 2)
    assert plan.seq_length == 64
    with pytest.raises(TeraPipeArgumentError, match=r"--terapipe-cost-model .*bad.json.*another model"):
        plan_from_args(parse(["--pipeline-schedule", "terapipe", "--terapipe-cost-model", str(bad)]), 64, 2)


def plan_from_args(args, seq_length: int, micro_batch_size: int):
    """The plan alone, as one process chooses it (no collectives, no measuring)."""
    return plan_and_report(args, seq_length, micro_batch_size)[0]


# ---- the profile cache --------------------------------------------------------------------
class CountingMeasure:
    """Stands in for measuring a layer: synthetic times, and a count of the calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, settings, cells):
        from megatron_terapipe.planner.profile.time_samples import LayerMeasurements

        self.calls += 1
        b, l, c = (list(x) for x in zip(*cells))
        fwd = [2e-4 + 1e-5 * bb * ll * (1 + cc / 256) for bb, ll, cc in cells]
        wgrad = [None if cc else 0.6 * t for t, cc in zip(fwd, c)]  # context-free cells only
        return LayerMeasurements(b, l, c, fwd, [2 * t for t in fwd], metadata={},
                                 deferred_backward=[None if w is None else 2 * t - w
                                                    for t, w in zip(fwd, wgrad)],
                                 wgrad=wgrad)


def test_profile_is_measured_once_then_read_from_the_cache(tmp_path, capsys):
    argv = ["--pipeline-schedule", "terapipe", "--terapipe-cost-model", "profile",
            "--terapipe-cache-dir", str(tmp_path)]
    measure = CountingMeasure()
    first = ArgsPlanProvider.from_args(parse(argv), measure=measure)
    plan = first.plan_for(64, 2)
    assert measure.calls == 1 and first.measurements == 1 and first.cache_hits == 0
    path = profile_cache_path(run_settings(parse(argv), 64, 2))
    assert path.is_file() and path.parent == tmp_path
    stored = json.loads(path.read_text())
    assert stored["metadata"]["cache_key"]["model"]["hidden_size"] == 64
    assert "measuring one layer" in capsys.readouterr().out

    # a second start: same shape, device and versions -> no measurement
    again = ArgsPlanProvider.from_args(parse(argv), measure=measure)
    assert again.plan_for(64, 2) == plan
    assert measure.calls == 1 and again.measurements == 0 and again.cache_hits == 1
    assert "measuring one layer" not in capsys.readouterr().out

    # another model shape is another cache entry
    other = parse(argv, hidden_size=128)
    assert profile_cache_path(run_settings(other, 64, 2)) != path
    ArgsPlanProvider.from_args(other, measure=measure).plan_for(64, 2)
    assert measure.calls == 2

    # an entry written in an older profile format is measured again and overwritten
    stored["format_version"] = 2
    del stored["fit"]["wgrad"]
    path.write_text(json.dumps(stored))
    ArgsPlanProvider.from_args(parse(argv), measure=measure).plan_for(64, 2)
    assert measure.calls == 3
    assert json.loads(path.read_text())["format_version"] == 3


def test_cache_key_covers_shape_device_and_versions():
    key = profile_cache_key(run_settings(parse(["--pipeline-schedule", "terapipe"]), 64, 2))
    assert {"model", "tensor_parallel", "dtype", "seq_length", "micro_batch_size", "device",
            "versions"} <= set(key)
    assert {"torch", "megatron.core", "megatron_terapipe"} <= set(key["versions"])


def test_setup_from_args_selects_and_deselects():
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: F401

    from megatron_terapipe.megatron.hooks import install, selection

    try:
        provider = setup_from_args(parse(["--pipeline-schedule", "terapipe", "--terapipe-num-slices", "2"]))
        assert isinstance(provider, ArgsPlanProvider)
        assert selection.selected() and selection.default_plan_source() is provider
        import megatron.core.pipeline_parallel as pp

        schedule = pp.get_forward_backward_func()
        assert schedule.__name__ == "forward_backward_terapipe"
        assert setup_from_args(parse([])) is None
        assert not selection.selected()
        assert pp.get_forward_backward_func(pp_size=2, vp_size=None).__name__ == \
            "forward_backward_pipelining_without_interleaving"
        with pytest.raises(TeraPipeArgumentError, match="--context-parallel-size"):
            setup_from_args(parse(["--pipeline-schedule", "terapipe"], context_parallel_size=2))
    finally:
        selection.deselect()
        install.use_slice_attention_in_gpt_models(False)


def test_the_slice_aware_model_under_megatrons_schedule(capsys):
    """--terapipe-slice-aware-model keeps Megatron's schedule and builds GPT models with
    slice-aware attention (the matrix checks it trains as plain 1f1b); a TE attention backend
    is refused naming the flag."""
    from megatron_terapipe.megatron.hooks import install, selection

    try:
        assert setup_from_args(parse(["--terapipe-slice-aware-model"])) is None
        assert not selection.selected() and install._SLICE_ATTENTION_IN_GPT_MODELS
        assert "--terapipe-slice-aware-model" in capsys.readouterr().out
        setup_from_args(parse([]))
        assert not install._SLICE_ATTENTION_IN_GPT_MODELS
        with pytest.raises(TeraPipeArgumentError, match=r"^--terapipe-slice-aware-model builds "
                           r".*--attention-backend flash: use --attention-backend auto or local"):
            setup_from_args(parse(["--terapipe-slice-aware-model"], attention_backend="flash"))
    finally:
        selection.deselect()
        install.use_slice_attention_in_gpt_models(False)


# ---- every rank gets rank 0's plan ------------------------------------------------------------
def plan_on_every_rank(rank: int, world_size: int, hardware: list[str], cache_dir: str,
                       measured: bool):
    """Worker: each rank sees a different hardware flag; the provider must still agree."""
    argv = ["--pipeline-schedule", "terapipe", "--terapipe-hardware", hardware[rank],
            "--terapipe-granularity", "64"]
    big = dict(seq_length=2048, num_layers=24, hidden_size=2048, num_attention_heads=16,
               pipeline_model_parallel_size=4, global_batch_size=8, micro_batch_size=1, world_size=4)
    args = parse(argv, **big)
    provider = ArgsPlanProvider.from_args(args, log=False)
    result = {"plan": provider.plan_for(2048, 1).to_dict(),
              "local": plan_from_args(args, 2048, 1).to_dict()}
    if measured:  # a real layer measured on every rank at once, fitted and cached by rank 0
        tiny = parse(["--pipeline-schedule", "terapipe", "--terapipe-cost-model", "profile",
                      "--terapipe-cache-dir", cache_dir, "--terapipe-profile-points", "3",
                      "--terapipe-granularity", "16"], hidden_size=32, seq_length=64)
        profiled = ArgsPlanProvider.from_args(tiny, log=False)
        result["profiled"] = profiled.plan_for(64, 2).to_dict()
        result["measurements"] = profiled.measurements
        result["cache_hits"] = profiled.cache_hits
    return result


def test_every_rank_gets_rank_zeros_plan_and_the_profile_is_cached(tmp_path):
    hardware = ["v100", "h100"]
    first = spawn(2, "test_arguments:plan_on_every_rank", hardware, str(tmp_path), True, timeout=300)
    plans = [r["plan"] for r in first]
    assert plans[0] == plans[1] == first[0]["local"]
    assert first[1]["local"] != first[0]["local"]  # rank 1 alone would have chosen otherwise
    assert first[0]["profiled"] == first[1]["profiled"]
    assert [r["measurements"] for r in first] == [1, 1]  # measured on every rank, once
    assert len(list(tmp_path.glob("layer-profile-*.json"))) == 1
    second = spawn(2, "test_arguments:plan_on_every_rank", hardware, str(tmp_path), True, timeout=300)
    assert [r["measurements"] for r in second] == [0, 0]  # second start: cache hit, no measuring
    assert [r["cache_hits"] for r in second] == [1, 1]
    assert second[0]["profiled"] == second[1]["profiled"] == first[0]["profiled"]


def test_provider_error_on_rank_zero_reaches_every_rank():
    messages = spawn(2, "test_arguments:bad_slices_on_every_rank", timeout=120)
    assert all("sum to 48 tokens but the sequence has 64" in m for m in messages)


def bad_slices_on_every_rank(rank: int, world_size: int):
    """Rank 0's plan fails (rank 1's alone would not): every rank must raise, none may hang."""
    args = parse(["--pipeline-schedule", "terapipe", "--terapipe-slices", "32", "16"])
    try:
        ArgsPlanProvider.from_args(args, log=False).plan_for(64 if rank == 0 else 48, 2)
    except TeraPipeArgumentError as exc:
        return str(exc)
    return "no error"


def test_plan_round_trip():
    plan = TeraPipePlan([32, 32], order="gpipe", predicted_time=1.5)
    assert TeraPipePlan.from_dict(plan.to_dict()) == plan
