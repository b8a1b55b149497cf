"""Mistakes in the flags stop the run, naming the flag and the fix, instead of passing silently:
prediction inputs with fixed slices (a bad cost-model file, a budget the plan cannot meet,
--terapipe-defer-wgrad auto), dropout under CUDA graphs without Megatron's graph-safe RNG
tracker, Megatron's own CUDA graphs (--cuda-graph-impl) and its combined 1F1B
(--overlap-moe-expert-parallel-comm), --attention-backend values TeraPipe does not run, and a
GPU preset assumed for a device that matches none (a warning in the start-up report)."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_terapipe import TeraPipeConfig, TeraPipePlan
from megatron_terapipe.megatron.args import inputs_from_flags as planner_inputs_module
from megatron_terapipe.megatron.args.auto_schedule import resolve_auto_schedule
from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from megatron_terapipe.megatron.args.settings import RunSettings
from megatron_terapipe.megatron.hooks import selection
from harness.inputs.flags import parse, plan_and_report

TERAPIPE = ["--pipeline-schedule", "terapipe"]
FIXED = [["--terapipe-num-slices", "4"], ["--terapipe-slices", "32", "16", "16"], []]  # [] planner


# ---- fixed slices: what the prediction starts from is checked as the planner's is ----------
@pytest.fixture
def truncated_profile(tmp_path):
    path = tmp_path / "layer-profile.json"
    path.write_text('{"format": "megatron-terapipe-layer-profile", "fit": {"forw')
    return str(path)


@pytest.mark.parametrize("slices", FIXED, ids=["num_slices", "slices", "planner"])
def test_truncated_cost_model_file_names_the_file(slices, truncated_profile):
    with pytest.raises(TeraPipeArgumentError) as info:
        plan_and_report(parse(TERAPIPE + slices + ["--terapipe-cost-model", truncated_profile]), 64, 2)
    message = str(info.value)
    assert message.startswith(f"--terapipe-cost-model {truncated_profile}: ")
    assert "not valid JSON (truncated or corrupt?)" in message


@pytest.mark.parametrize("slices", FIXED, ids=["num_slices", "slices", "planner"])
def test_unmeetable_memory_budget_names_the_flag(slices):
    with pytest.raises(TeraPipeArgumentError) as info:
        plan_and_report(parse(TERAPIPE + slices + ["--terapipe-memory-budget", "1KiB"]), 64, 2)
    message = str(info.value)
    assert message.startswith("--terapipe-memory-budget: ")
    assert "memory budget of 1.0 KiB per GPU" in message and "give more memory" in message


def test_auto_deferral_never_falls_back_to_deferral_on(truncated_profile):
    argv = TERAPIPE + ["--terapipe-num-slices", "4", "--terapipe-defer-wgrad", "auto"]
    with pytest.raises(TeraPipeArgumentError, match="--terapipe-cost-model"):
        plan_and_report(parse(argv + ["--terapipe-cost-model", truncated_profile]), 64, 2)
    shapeless = parse(argv, num_layers=None, hidden_size=None, num_attention_heads=None)
    with pytest.raises(TeraPipeArgumentError) as info:
        plan_and_report(shapeless, 64, 2)
    assert str(info.value).startswith("--terapipe-defer-wgrad auto needs the plan's predicted")
    assert "choose --terapipe-defer-wgrad on or off" in str(info.value)


def test_fixed_slices_without_a_model_shape_run_unpredicted_unless_a_flag_needs_it():
    """A script without Megatron-LM's model flags may fix the slices: the plan runs as given,
    the report says there is no prediction; a budget cannot be checked, so it is refused."""
    shapeless = dict(num_layers=None, hidden_size=None, num_attention_heads=None)
    plan, report = plan_and_report(parse(TERAPIPE + ["--terapipe-num-slices", "4"], **shapeless), 64, 2)
    assert plan.token_slices == ((16, 16, 16, 16),) and plan.predicted_time is None
    assert any(line.startswith(">   note: no prediction: the flags give no model shape")
               for line in report.lines(plan))
    with pytest.raises(TeraPipeArgumentError, match="^--terapipe-memory-budget needs the plan's"):
        plan_and_report(parse(TERAPIPE + ["--terapipe-num-slices", "4", "--terapipe-memory-budget",
                                          "70GiB"], **shapeless), 64, 2)


# ---- CUDA graphs and dropout --------------------------------------------------------------
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)  # Megatron-LM's defaults
GRAPHS = TERAPIPE + ["--terapipe-cuda-graphs"]


def test_cuda_graphs_with_dropout_need_the_graph_safe_rng_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA check passes
    with pytest.raises(TeraPipeArgumentError) as info:
        validate_terapipe_args(parse(GRAPHS, **DROPOUT))
    message = str(info.value)
    for flag in ("--terapipe-cuda-graphs", "--hidden-dropout 0.1", "--attention-dropout 0.1",
                 "--te-rng-tracker"):
        assert flag in message
    with pytest.raises(TeraPipeArgumentError, match=r"\(--attention-dropout 0.2\)"):
        validate_terapipe_args(parse(GRAPHS, hidden_dropout=0.0, attention_dropout=0.2))
    validate_terapipe_args(parse(GRAPHS, te_rng_tracker=True, **DROPOUT))
    validate_terapipe_args(parse(GRAPHS, hidden_dropout=0.0, attention_dropout=0.0))
    validate_terapipe_args(parse(TERAPIPE, **DROPOUT))  # no graphs: dropout is fine


def test_dropout_refusal_comes_before_the_cuda_check():
    """On a machine without CUDA the dropout refusal is reached first (it does not depend on one)."""
    with pytest.raises(TeraPipeArgumentError, match="--te-rng-tracker"):
        validate_terapipe_args(parse(GRAPHS, **DROPOUT))


@pytest.fixture
def rng_tracker(monkeypatch):
    """Megatron's global RNG tracker, set per test: (graph-safe or not) -> the tracker installed."""
    from megatron.core.tensor_parallel import random as tp_random

    def install(graph_safe: bool):
        tracker = tp_random.CudaRNGStatesTracker()
        tracker.use_cudagraphable_rng = graph_safe  # what Megatron's graph-safety check reads
        monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER", tracker)
        monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
        return tracker

    return install


def test_configure_refuses_dropout_in_graphs_without_a_graph_safe_tracker(rng_tracker):
    from megatron_terapipe.megatron.hooks.forward_backward import check_support

    rng_tracker(graph_safe=False)
    config = argparse.Namespace(**DROPOUT)
    try:
        with pytest.raises(ValueError, match=r"configure\(\.\.\., cuda_graphs=True\) captures "
                                             r"dropout \(--hidden-dropout 0.1, --attention-dropout 0.1\)"):
            selection.configure(config, TeraPipePlan([32, 32]), cuda_graphs=True,
                                graph_factory=lambda label: None)
        with pytest.raises(ValueError, match="te_rng_tracker=True"):  # at the schedule's call too
            check_support(argparse.Namespace(terapipe=TeraPipeConfig(cuda_graphs=True), **DROPOUT), None)
        rng_tracker(graph_safe=True)
        selection.configure(config, TeraPipePlan([32, 32]), cuda_graphs=True,
                            graph_factory=lambda label: None)
        check_support(argparse.Namespace(terapipe=TeraPipeConfig(cuda_graphs=True), **DROPOUT), None)
    finally:
        selection.deselect()


# ---- Megatron's own CUDA graphs ------------------------------------------------------------
# Megatron-LM's older flags become --cuda-graph-impl in its validate_args (and in a 0.16 config)
MEGATRON_GRAPHS = [(dict(cuda_graph_impl="local"), "local"),
                   (dict(cuda_graph_impl="transformer_engine"), "transformer_engine"),
                   (dict(enable_cuda_graph=True), "local"),
                   (dict(external_cuda_graph=True), "transformer_engine")]


@pytest.mark.parametrize("fields, impl", MEGATRON_GRAPHS,
                         ids=["local", "te", "enable_cuda_graph", "external_cuda_graph"])
def test_megatrons_own_cuda_graphs_are_refused(fields, impl):
    """They are made around Megatron's own schedules and would fix a slice's K/V offset: the
    refusal names the flag and TeraPipe's own graphs, from the flags and from a config."""
    from megatron.core.transformer import TransformerConfig

    for schedule in ("terapipe", "auto"):
        with pytest.raises(TeraPipeArgumentError) as info:
            validate_terapipe_args(parse(["--pipeline-schedule", schedule], **fields))
        message = str(info.value)
        assert f"--cuda-graph-impl {impl}" in message and "--terapipe-cuda-graphs" in message
    validate_terapipe_args(parse(["--pipeline-schedule", "1f1b"], **fields))
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **fields)
    with pytest.raises(ValueError, match=f"--cuda-graph-impl {impl}"):
        selection.configure(config, TeraPipePlan([32, 32]))
    validate_terapipe_args(parse(TERAPIPE, cuda_graph_impl="none"))


# ---- Megatron's combined 1F1B (expert-parallel all-to-all overlap) -------------------------
@pytest.mark.parametrize("fields, named", [
    (dict(overlap_moe_expert_parallel_comm=True), "--overlap-moe-expert-parallel-comm"),
    (dict(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True),
     "--overlap-moe-expert-parallel-comm and --delay-wgrad-compute"),
], ids=["overlap", "overlap_and_delayed_wgrad"])
def test_megatrons_combined_1f1b_is_refused(fields, named):
    """With --delay-wgrad-compute the experts' weight gradients wait for Megatron's combined
    1F1B to compute them: under TeraPipe's schedule they never would."""
    moe = dict(num_experts=4, expert_model_parallel_size=2)
    for schedule in ("terapipe", "auto"):
        with pytest.raises(TeraPipeArgumentError) as info:
            validate_terapipe_args(parse(["--pipeline-schedule", schedule], **moe, **fields))
        assert named in str(info.value) and "--pipeline-schedule 1f1b" in str(info.value)
    config = argparse.Namespace(num_moe_experts=4, **fields)  # Megatron's config needs EP > 1
    with pytest.raises(ValueError, match=named):
        selection.configure(config, TeraPipePlan([32, 32]))


# ---- --attention-backend -----------------------------------------------------------------
@pytest.mark.parametrize("backend", ["flash", "fused", "unfused"])
def test_attention_backends_terapipe_does_not_run_are_refused(backend):
    from megatron.core.transformer.enums import AttnBackend

    for value in (backend, AttnBackend[backend]):  # a string, or the enum Megatron-LM parses
        with pytest.raises(TeraPipeArgumentError) as info:
            validate_terapipe_args(parse(TERAPIPE, attention_backend=value))
        assert f"--attention-backend {backend}" in str(info.value)
        assert "slice attention" in str(info.value) and "auto (the default) or local" in str(info.value)
    with pytest.raises(ValueError, match=f"--attention-backend {backend}"):  # the Python API
        selection.check_config(argparse.Namespace(attention_backend=AttnBackend[backend]), None)


def test_attention_backend_auto_and_local_run_slice_attention_and_the_report_says_so():
    from megatron.core.transformer.enums import AttnBackend

    for value in ("auto", "local", AttnBackend.auto, AttnBackend.local, None):
        args = parse(TERAPIPE + ["--terapipe-num-slices", "4"], attention_backend=value)
        validate_terapipe_args(args)
        plan, report = plan_and_report(args, 64, 2)
        name = getattr(value, "name", value) or "auto"
        assert (">   attention ................. slice attention (torch scaled_dot_product_attention "
                "over the cached prefix, bottom-right causal mask; torch picks the kernel, on "
                "CPU split in two for slices over 512 tokens), for "
                f"--attention-backend {name}") in report.lines(plan)


# ---- a device without a GPU preset -------------------------------------------------------
@pytest.mark.parametrize("device, hardware, warned", [
    ("cpu (x86_64, unknown)", [], True),
    ("NVIDIA L40S", [], True),
    ("NVIDIA H100 80GB HBM3", [], False),
    ("cpu (x86_64, unknown)", ["--terapipe-hardware", "v100"], False),
])
def test_assumed_gpu_preset_is_a_warning_in_the_report(monkeypatch, device, hardware, warned):
    monkeypatch.setattr(planner_inputs_module, "device_name", lambda: device)
    plan, report = plan_and_report(parse(TERAPIPE + ["--terapipe-num-slices", "4"] + hardware), 64, 2)
    warnings = [line for line in report.lines(plan) if line.startswith("> terapipe: WARNING:")]
    assert bool(warnings) == warned
    if warned:
        assert warnings == [
            "> terapipe: WARNING: the analytic cost model assumes A100 GPUs: device "
            f"'{device}' matches no preset; give --terapipe-hardware {{v100,a100,h100}} for the "
            "GPUs the run trains on, or --terapipe-cost-model profile to measure this device"]
        assert "on a100" in report.cost_model


def test_auto_schedule_logs_the_assumed_gpu_preset(monkeypatch):
    monkeypatch.setattr(planner_inputs_module, "device_name", lambda: "cpu (x86_64, unknown)")
    lines: list[str] = []
    resolve_auto_schedule(RunSettings.from_args(parse(["--pipeline-schedule", "auto"])), log=lines.append)
    assert lines[-1].startswith("> terapipe auto: WARNING: the analytic cost model assumes A100")
