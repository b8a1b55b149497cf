"""terapipe-plan: output, files it writes, and errors that name the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner.cli.command import build_parser, main
from megatron_terapipe.planner.cli.arguments import inputs_from_options
from megatron_terapipe.planner.schedule_choice import TERAPIPE
from harness.paths import ROOT

BASE = ["--model", "gpt3-1b", "--pipeline-stages", "4", "--seq-length", "1024",
        "--granularity", "64"]


def test_prints_plan_and_comparison(capsys):
    assert main(BASE + ["--micro-batch-size", "2", "--num-microbatches", "2"]) == 0
    out, err = capsys.readouterr()
    # progress on stderr, each TeraPipe row of the table counted (gpt3-1b on 4 stages: 6
    # layers per stage, so 1, 2, 3 and 6 chunks in each of the two orders, then 2 in a V)
    progress = [line.split("s  ", 1)[1] for line in err.splitlines()
                if line.startswith("terapipe-plan:")]
    assert progress[0] == "planning TeraPipe 1f1b on one model chunk" and progress[-1] == "done"
    assert "planning TeraPipe 1f1b (1 of 10)" in progress
    assert "planning TeraPipe gpipe, 6 chunks (8 of 10)" in progress
    assert "planning TeraPipe gpipe, 2 chunks in a V (10 of 10)" in progress
    for text in ("TeraPipe 1f1b on one model chunk (", "TeraPipe DP", "uniform x", "no token slicing", "speedup",
                 "peak GiB per stage", "capped DPs"):
        assert text in out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.startswith(("TeraPipe DP", "no token slicing"))}
    assert rows["no"].rstrip().endswith("1.00x")  # the baseline's own speedup


def test_writes_trace_png_and_plan(tmp_path, capsys):
    """The files show auto's choice (here TeraPipe on virtual stages, whatever --order asks),
    and each file's line says which schedule it holds."""
    pytest.importorskip("matplotlib")
    trace, png, plan_path = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "plan.json"
    argv = BASE + ["--trace", str(trace), "--png", str(png), "--save-plan", str(plan_path),
                   "--order", "gpipe"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    parser = build_parser()
    choice = inputs_from_options(parser.parse_args(argv), parser).schedule_table().auto().chosen
    assert choice.plan is not None and choice.plan.virtual_stages > 1  # not the --order plan
    for line in (f"trace: {trace} ({choice.name}: auto's choice)",
                 f"timeline: {png} ({choice.name}: auto's choice)",
                 f"plan: {plan_path} ({choice.name}: auto's choice)"):
        assert line in out.splitlines()
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(choice.result.timeline)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = TeraPipePlan.from_dict(json.loads(plan_path.read_text()))
    assert plan == choice.plan and plan.predicted_time > 0


def test_saves_the_fastest_terapipe_plan_when_auto_runs_megatron(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    argv = BASE + ["--num-microbatches", "64", "--save-plan", str(plan_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    parser = build_parser()
    table = inputs_from_options(parser.parse_args(argv), parser).schedule_table()
    auto, best = table.auto().chosen, table.best(TERAPIPE)
    assert auto.family != TERAPIPE  # Megatron's interleaved schedule, within 3% of TeraPipe
    assert (f"plan: {plan_path} ({best.name}: the fastest TeraPipe schedule that fits; auto "
            f"runs {auto.name})") in out.splitlines()
    assert TeraPipePlan.from_dict(json.loads(plan_path.read_text())) == best.plan


def test_writes_nothing_when_nothing_fits(tmp_path, capsys):
    png, plan_path = tmp_path / "t.png", tmp_path / "plan.json"
    assert main(BASE + ["--memory-budget", "1GiB", "--png", str(png),
                        "--save-plan", str(plan_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"--png {png}: not written, no schedule fits the memory budget" in out
    assert f"--save-plan {plan_path}: not written, no TeraPipe schedule fits the memory budget" in out
    assert not png.exists() and not plan_path.exists()


def test_custom_model_dimensions(capsys):
    assert main(["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8",
                 "--pipeline-stages", "2", "--seq-length", "512", "--granularity", "32",
                 "--hardware", "h100"]) == 0
    assert "8 layers, hidden 1024" in capsys.readouterr().out


@pytest.mark.parametrize("argv,flag", [
    (["--pipeline-stages", "0"], "--pipeline-stages"),
    (["--pipeline-stages", "5"], "--pipeline-stages"),  # 24 layers do not split in 5
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size"),
    (["--granularity", "100"], "--granularity"),
    (["--seq-length", "-4"], "--seq-length"),
    (["--hardware", "tpu"], "--hardware"),
    (["--batch-sizes", "3,5"], "--batch-sizes"),
    (["--profile", "/nonexistent/profile.json"], "--profile"),
])
def test_bad_flags_are_named(argv, flag, capsys):
    args = list(BASE)
    for i in range(0, len(argv), 2):  # later flags override earlier ones in argparse
        args += argv[i:i + 2]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_model_is_required(capsys):
    with pytest.raises(SystemExit):
        main(["--pipeline-stages", "2", "--seq-length", "64"])
    assert "--num-layers" in capsys.readouterr().err


def test_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "megatron_terapipe.planner.cli", *BASE],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "TeraPipe DP" in proc.stdout


def _synthetic_profile(tmp_path, hidden=2048, heads=16):
    """A layer profile of the paper's form for the gpt3-1b shape (no measuring needed)."""
    import numpy as np

    from megatron_terapipe.planner import ModelDims, fit_layer_times
    from megatron_terapipe.planner.profile.time_samples import LayerMeasurements, default_grid

    cells = np.array(default_grid(1024, [1, 2], granularity=64, points=5), dtype=float)
    b, l, c = cells.T
    t = 3e-4 + b * (4e-6 * l + 2e-9 * l * c)
    model = ModelDims(num_layers=24, hidden_size=hidden, num_attention_heads=heads)
    meta = {"device": "synthetic", "dtype": "bfloat16", "model": model.to_dict(), "tensor_parallel": 1}
    return fit_layer_times(LayerMeasurements(b, l, c, t, 2 * t, meta)).save(tmp_path / "profile.json")


def test_profile_flag_uses_the_profile(tmp_path, capsys):
    path = _synthetic_profile(tmp_path)
    assert main(BASE + ["--profile", str(path)]) == 0
    assert "profiled: synthetic bfloat16" in capsys.readouterr().out


def test_profile_of_another_model_is_refused(tmp_path, capsys):
    path = _synthetic_profile(tmp_path, hidden=1024, heads=8)
    with pytest.raises(SystemExit):
        main(BASE + ["--profile", str(path)])
    err = capsys.readouterr().err
    assert "--profile" in err and "profile.json" in err and "hidden_size" in err


def test_terapipe_plan_starts_without_torch_or_megatron():
    """The planner is numpy only: terapipe-plan must not pay torch's and Megatron-Core's import
    (1.7 s on this machine); the package imports them on first use of a name that needs them."""
    code = ("import sys, megatron_terapipe.planner.cli.command, megatron_terapipe as mt; "
            "assert mt.TeraPipePlan and mt.solve; "
            "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules)); "
            "mt.get_gpt_layer_spec; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr


def _flags_line(out: str) -> list[str]:
    line = next(l for l in out.splitlines() if l.startswith("Megatron-LM flags for it"))
    return line.split(": ", 1)[1].split()


def test_the_flags_line_runs_autos_choice(capsys, monkeypatch):
    """The printed flags, in a Megatron-LM script with the question's model and parallel
    flags, make the start-up planner plan the very plan terapipe-plan's auto chose (TeraPipe
    on 3 model chunks here), and name the schedule of a Megatron choice."""
    from megatron_terapipe.megatron.args.plans_from_flags import plan_run
    from megatron_terapipe.megatron.args.settings import RunSettings
    from megatron_terapipe.planner.cost.presets import MODEL_PRESETS
    from harness.inputs.flags import parse

    argv = BASE + ["--memory-budget", "40GiB", "--granularity", "128"]
    assert main(argv) == 0
    flags = _flags_line(capsys.readouterr().out)
    parser = build_parser()
    choice = inputs_from_options(parser.parse_args(argv), parser).schedule_table().auto().chosen
    assert choice.family == TERAPIPE and choice.num_chunks > 1
    at = flags.index("--num-virtual-stages-per-pipeline-rank")  # Megatron's own flag
    chunks = int(flags[at + 1])
    assert chunks == choice.num_chunks
    assert flags[:2] == ["--pipeline-schedule", "terapipe"]
    assert "--terapipe-memory-budget" in flags and "--terapipe-granularity" in flags
    model = MODEL_PRESETS["gpt3-1b"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # the presets' GPUs per node

    def planned(terapipe_flags):
        args = parse(terapipe_flags, num_layers=model.num_layers, hidden_size=model.hidden_size,
                     num_attention_heads=model.num_attention_heads, vocab_size=model.vocab_size,
                     seq_length=1024, bf16=True, pipeline_model_parallel_size=4, world_size=4,
                     micro_batch_size=1, global_batch_size=1,
                     virtual_pipeline_model_parallel_size=chunks,
                     num_virtual_stages_per_pipeline_rank=chunks)
        return plan_run(RunSettings.from_args(args).for_batch(1024, 1)).plan.to_dict()

    terapipe_flags = flags[:at] + flags[at + 2:]
    assert planned(terapipe_flags) == choice.plan.to_dict()  # predicted time included
    other = [("a100" if f == "v100" else f) for f in terapipe_flags]  # can differ
    assert planned(other) != choice.plan.to_dict()

    assert main(BASE + ["--num-microbatches", "64"]) == 0
    flags = _flags_line(capsys.readouterr().out)
    assert flags[:2] == ["--pipeline-schedule", "1f1b"]  # Megatron's interleaved 1F1B
    assert not any(f.startswith("--terapipe") for f in flags)


def test_the_flags_line_leaves_out_only_what_both_sides_default_to():
    """The flags line gives --terapipe-granularity, --terapipe-defer-wgrad and
    --terapipe-wgrad-placement only where terapipe-plan was given other than its default,
    which must then be the Megatron-LM flags' default too."""
    from harness.inputs.flags import parse

    options = build_parser().parse_args(["--model", "gpt3-1b", "--pipeline-stages", "4",
                                         "--seq-length", "1024"])  # every default
    flags = parse([])
    assert flags.terapipe_granularity == options.granularity
    assert flags.terapipe_defer_wgrad == options.defer_wgrad
    assert flags.terapipe_wgrad_placement == options.wgrad_placement


#: A Megatron-LM script's model, parallel and batch flags, as its own names give them: a
#: Llama-style model (SwiGLU, grouped-query attention, untied output layer) on TP 2 x PP 4 x DP 2.
MEGATRON_LM_FLAGS = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
                     "--group-query-attention", "--num-query-groups", "4", "--swiglu",
                     "--vocab-size", "32000", "--seq-length", "4096", "--micro-batch-size", "1",
                     "--global-batch-size", "16", "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "4", "--use-distributed-optimizer", "--bf16",
                     "--untie-embeddings-and-output-weights"]
#: The same as Megatron-LM's parsed args hold them (its ffn default for SwiGLU applied).
MEGATRON_LM_ARGS = dict(num_layers=16, hidden_size=2048, num_attention_heads=16,
                        group_query_attention=True, num_query_groups=4, swiglu=True,
                        ffn_hidden_size=int(4 * 2048 * 2 / 3 / 64) * 64, vocab_size=32000,
                        seq_length=4096, micro_batch_size=1, global_batch_size=16,
                        tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
                        use_distributed_optimizer=True, bf16=True,
                        untie_embeddings_and_output_weights=True, world_size=16)


@pytest.mark.parametrize("chunks, group", [(1, None), (2, None), (2, 4)])
def test_megatron_lm_flags_ask_the_question_the_run_plans(chunks, group, monkeypatch):
    """terapipe-plan reads a Megatron-LM script's own flags (Megatron's names, --global-batch-size,
    --swiglu, --group-query-attention, --use-distributed-optimizer, --bf16,
    --num-layers-per-virtual-pipeline-stage and the microbatch group): the same model,
    microbatches, model state and TeraPipe plan (on one chunk, or on the run's 2, in the run's
    groups), predicted time included, as the start-up planner of a Megatron-LM run with those
    flags."""
    from megatron_terapipe.megatron.args.plans_from_flags import plan_run
    from megatron_terapipe.megatron.args.settings import RunSettings
    from harness.inputs.flags import parse

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # the presets' GPUs per node
    flags, megatron = list(MEGATRON_LM_FLAGS), dict(MEGATRON_LM_ARGS)
    if chunks > 1:  # 4 layers per stage in chunks of 2, as Megatron-LM's validated args hold it
        flags += ["--num-layers-per-virtual-pipeline-stage", "2"]
        megatron.update(num_layers_per_virtual_pipeline_stage=2,
                        virtual_pipeline_model_parallel_size=2)
    if group is not None:
        flags += ["--microbatch-group-size-per-virtual-pipeline-stage", str(group)]
        megatron.update(microbatch_group_size_per_vp_stage=group)
    parser = build_parser()
    options = parser.parse_args(flags + ["--data-parallel-size", "2", "--hardware", "a100"])
    ours = inputs_from_options(options, parser)
    run = RunSettings.from_args(parse(["--pipeline-schedule", "terapipe", "--terapipe-hardware",
                                       "a100"], **megatron))
    planned = plan_run(run.for_batch(4096, 1))
    assert ours.space.num_microbatches == run.shape.num_microbatches == 8  # 16 / (1 x DP 2)
    assert ours.model == replace(run.model, name=ours.model.name)
    assert ours.model.gated_linear_unit and ours.model.ffn == 5440 and ours.model.kv_hidden == 512
    assert ours.budget.model_state == planned.inputs.budget.model_state
    assert ours.space.virtual_stages == ((2,) if chunks > 1 else (2, 4))  # auto: every divisor
    mine = ours.search_virtual("1f1b", 2).plan if chunks > 1 else ours.search().plan
    assert planned.plan.virtual_stages == chunks
    assert group is None or planned.plan.virtual_group == group
    assert mine.to_dict() == planned.plan.to_dict()


def test_the_microbatch_group_prices_both_families_in_it(capsys):
    """Groups of 3 of 8 microbatches on 4 stages: Megatron's interleaved schedule refuses them
    (a group needs 4 microbatches), TeraPipe's 1f1b rows on chunks run them with 2 slices."""
    assert main(BASE + ["--num-microbatches", "8",
                        "--microbatch-group-size-per-virtual-pipeline-stage", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "chunks " in line]
    megatron = [r for r in rows if r.lstrip().startswith("Megatron interleaved")]
    assert megatron and all("cannot run: Megatron's interleaved schedule needs between 4" in r
                            and "got 3" in r for r in megatron)
    ours = [r for r in rows if r.lstrip().startswith("TeraPipe 1f1b")]
    assert ours and all(r.rstrip().endswith("groups of 3") and "2 slices" in r for r in ours)


@pytest.mark.parametrize("extra, message", [
    (["--global-batch-size", "12", "--micro-batch-size", "1", "--data-parallel-size", "8"],
     "--global-batch-size 12 is not a multiple of --micro-batch-size x --data-parallel-size"),
    (["--global-batch-size", "8", "--num-microbatches", "4"], "--num-microbatches 4 and "
     "--global-batch-size 8 (that is 8 microbatches): give one"),
    (["--recompute-granularity", "selective"], "prices Megatron's full recomputation only"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--num-layers-per-virtual-pipeline-stage", "4"], "--num-layers-per-virtual-pipeline-stage 4 "
     "does not divide the 6 layers of a stage"),
    (["--num-layers-per-virtual-pipeline-stage", "2", "--virtual-stages", "3"], "give one"),
])
def test_megatron_lm_flags_that_cannot_be_planned_name_themselves(extra, message, capsys):
    with pytest.raises(SystemExit):
        main(BASE + extra)
    assert message in capsys.readouterr().err
