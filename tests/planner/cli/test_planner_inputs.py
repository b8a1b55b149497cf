"""One configuration asked two ways: terapipe-plan's options and Megatron-LM's flags build the
same PlannerInputs (model, cost model, search space, budget) and the planner gives the same plan
with the same predicted time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_terapipe.megatron.args.inputs_from_flags import planner_inputs
from megatron_terapipe.megatron.args.settings import RunSettings
from megatron_terapipe.planner.cli.command import build_parser
from megatron_terapipe.planner.cli.arguments import inputs_from_options
from megatron_terapipe.planner.cost.presets import MODEL_PRESETS
from harness.inputs.flags import parse

# (terapipe-plan options, Megatron-LM flags and TeraPipe flags beyond the model shape)
CONFIGS = {
    "1b, 4 stages, defaults": (
        ["--pipeline-stages", "4"],
        dict(pipeline_model_parallel_size=4, world_size=4, micro_batch_size=1,
             global_batch_size=1), []),
    "13b, 8 stages, TP 2, 4 microbatches of 2, gpipe": (
        ["--pipeline-stages", "8", "--tensor-parallel-size", "2", "--micro-batch-size", "2",
         "--num-microbatches", "4", "--order", "gpipe", "--granularity", "16"],
        dict(pipeline_model_parallel_size=8, tensor_model_parallel_size=2, world_size=16,
             micro_batch_size=2, global_batch_size=8),
        ["--terapipe-order", "gpipe", "--terapipe-granularity", "16"]),
    "13b, 8 stages x TP 8, sequence parallel, 8 microbatches, a budget": (
        ["--pipeline-stages", "8", "--tensor-parallel-size", "8", "--sequence-parallel",
         "--num-microbatches", "8", "--granularity", "64", "--memory-budget", "16GiB",
         "--hardware", "h100"],
        dict(pipeline_model_parallel_size=8, tensor_model_parallel_size=8, world_size=64,
             micro_batch_size=1, global_batch_size=8, sequence_parallel=True),
        ["--terapipe-granularity", "64", "--terapipe-memory-budget", "16GiB",
         "--terapipe-hardware", "h100"]),
    "13b, 8 stages, TP 2, 4 microbatches of 2, gpipe, W places off": (
        ["--pipeline-stages", "8", "--tensor-parallel-size", "2", "--micro-batch-size", "2",
         "--num-microbatches", "4", "--order", "gpipe", "--granularity", "16",
         "--wgrad-placement", "off"],
        dict(pipeline_model_parallel_size=8, tensor_model_parallel_size=2, world_size=16,
             micro_batch_size=2, global_batch_size=8),
        ["--terapipe-order", "gpipe", "--terapipe-granularity", "16",
         "--terapipe-wgrad-placement", "off"]),
    "1b, 2 stages x DP 4, distributed optimizer, a budget": (
        ["--pipeline-stages", "2", "--data-parallel-size", "4", "--distributed-optimizer",
         "--memory-budget", "12GiB", "--hardware", "a100"],
        dict(pipeline_model_parallel_size=2, world_size=8, micro_batch_size=1,
             global_batch_size=4, use_distributed_optimizer=True),
        ["--terapipe-memory-budget", "12GiB", "--terapipe-hardware", "a100"]),
    "13b, 20 stages across nodes, untied output layer, deferral off": (
        ["--pipeline-stages", "20", "--untie-embeddings-and-output-weights",
         "--defer-wgrad", "off", "--model-state-memory", "4GiB"],
        dict(pipeline_model_parallel_size=20, world_size=20, micro_batch_size=1,
             global_batch_size=1, untie_embeddings_and_output_weights=True),
        ["--terapipe-defer-wgrad", "off", "--terapipe-model-state-memory", "4GiB"]),
}


def _both(name: str, monkeypatch):
    cli_argv, megatron, terapipe = CONFIGS[name]
    preset = "gpt3-13b" if name.startswith("13b") else "gpt3-1b"
    model = MODEL_PRESETS[preset]
    parser = build_parser()
    # virtual stages: Megatron-LM's flags give the chunks (--pipeline-schedule auto searches
    # them, auto_schedule.py); planned W places: both ways by default
    options = parser.parse_args(["--model", preset, "--seq-length", "2048", "--virtual-stages",
                                 "1", *cli_argv])
    if "--hardware" not in cli_argv:
        terapipe = terapipe + ["--terapipe-hardware", "v100"]  # terapipe-plan's default
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # the presets' GPUs per node
    flags = parse(["--pipeline-schedule", "terapipe", *terapipe],
                  num_layers=model.num_layers, hidden_size=model.hidden_size,
                  num_attention_heads=model.num_attention_heads, vocab_size=model.vocab_size,
                  seq_length=2048, bf16=True, **megatron)
    seq, mbs = 2048, megatron["micro_batch_size"]
    return inputs_from_options(options, parser), planner_inputs(
        RunSettings.from_args(flags).for_batch(seq, mbs))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_options_and_flags_give_the_same_inputs_and_plan(name, monkeypatch):
    from_options, from_flags = _both(name, monkeypatch)
    # the same model under two names (the preset's; Megatron-LM's flags have none)
    assert replace(from_options.model, name="") == replace(from_flags.model, name="")
    assert (from_options.cost_model.describe().replace(from_options.model.name, "M")
            == from_flags.cost_model.describe().replace(from_flags.model.name, "M"))
    assert from_options.cost_model.link == from_flags.cost_model.link
    assert from_options.space == from_flags.space
    assert from_options.budget == from_flags.budget
    assert from_options.layers_per_stage == from_flags.layers_per_stage
    plan_options, plan_flags = from_options.search().plan, from_flags.search().plan
    assert plan_options.to_dict() == plan_flags.to_dict()
    assert plan_options.predicted_time == pytest.approx(plan_flags.predicted_time, rel=1e-12)


def test_the_inputs_differ_where_the_configurations_do(monkeypatch):
    """The comparison can fail: a different budget or layout gives different inputs."""
    one, _ = _both("1b, 2 stages x DP 4, distributed optimizer, a budget", monkeypatch)
    _, other = _both("1b, 4 stages, defaults", monkeypatch)
    assert one.budget != other.budget and one.space != other.space
    placed, _ = _both("13b, 8 stages, TP 2, 4 microbatches of 2, gpipe", monkeypatch)
    _, default_places = _both("13b, 8 stages, TP 2, 4 microbatches of 2, gpipe, W places off",
                              monkeypatch)
    assert placed.search().plan.wgrad_after and not default_places.search().plan.wgrad_after
    sp, _ = _both("13b, 8 stages x TP 8, sequence parallel, 8 microbatches, a budget", monkeypatch)
    assert "sequence parallel" in sp.cost_model.describe() and sp.space.multiple_of == 8


def test_rampup_plans_no_w_places(monkeypatch):
    """--rampup-batch-size changes the microbatch count the places would be planned for:
    the flags' inputs keep W actions in their default places and say why."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    model = MODEL_PRESETS["gpt3-13b"]
    flags = parse(["--pipeline-schedule", "terapipe", "--terapipe-hardware", "v100",
                   "--terapipe-order", "gpipe", "--terapipe-granularity", "16"],
                  num_layers=model.num_layers, hidden_size=model.hidden_size,
                  num_attention_heads=model.num_attention_heads, vocab_size=model.vocab_size,
                  seq_length=2048, bf16=True, pipeline_model_parallel_size=8,
                  tensor_model_parallel_size=2, world_size=16, micro_batch_size=2,
                  global_batch_size=8, rampup_batch_size=["2", "2", "100"])
    inputs = planner_inputs(RunSettings.from_args(flags).for_batch(2048, 2))
    assert not inputs.space.place_wgrad and not inputs.search().plan.wgrad_after
    assert any("--rampup-batch-size" in note for note in inputs.notes)
