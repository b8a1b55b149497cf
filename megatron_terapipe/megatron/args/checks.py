"""Checking the flags before any work: `validate_terapipe_args` parses them (settings.py) and
raises TeraPipeArgumentError, naming the flag and the fix, for TeraPipe flags that make no
sense and, through the support rules (support/refusals.py), for what the schedule cannot run."""

from __future__ import annotations

import os

from ..support.refusals import SLICE_ATTENTION, SLICE_ATTENTION_BACKENDS, refusal
from .flags import COST_MODELS, HARDWARE_CHOICES, ORDERS
from .settings import (RunSettings, RunShape, TeraPipeArgumentError, TeraPipeSettings,
                       as_flag_error)

__all__ = ["TeraPipeArgumentError", "check_settings", "validate_terapipe_args"]


def _fail(message: str):
    raise TeraPipeArgumentError(message)


def validate_terapipe_args(args) -> RunSettings:
    """The flags as RunSettings, or TeraPipeArgumentError naming the flag and the fix for what
    TeraPipe cannot run. Reads Megatron-LM's argument names (seq_length,
    tensor_model_parallel_size, ...); attributes a script does not define count as unset. Runs
    before any work: no communication, no model."""
    return check_settings(RunSettings.from_args(args), args)


def check_settings(run: RunSettings, args) -> RunSettings:
    """validate_terapipe_args on flags already parsed (`run`, from `args`): returns `run`."""
    flags = run.terapipe
    if flags.auto_trials < 0:
        _fail(f"--terapipe-auto-trials must be 0 or more training iterations per candidate, got "
              f"{flags.auto_trials}: give 0 to keep auto's predicted pick, or 2 (the default) "
              "or more to measure")
    if not flags.selected and not flags.auto:
        given = flags.given_flags()
        if given:
            _fail(f"{given[0]} needs --pipeline-schedule terapipe or auto (the schedule is "
                  f"{flags.schedule}): add --pipeline-schedule terapipe or auto, or drop {given[0]}")
        backend = run.support.attention_backend
        if flags.slice_aware_model and backend not in SLICE_ATTENTION_BACKENDS:
            _fail(f"--terapipe-slice-aware-model builds TeraPipe's {SLICE_ATTENTION}, not "
                  f"--attention-backend {backend}: use --attention-backend auto or local, or "
                  "drop --terapipe-slice-aware-model")
        return run
    if flags.auto:
        _check_auto(run)
    if flags.order not in ORDERS:
        _fail(f"--terapipe-order must be one of {', '.join(ORDERS)}, got {flags.order!r}")
    if sum((bool(flags.slices), flags.num_slices is not None, flags.edge_slices is not None)) > 1:
        _fail("--terapipe-slices, --terapipe-num-slices and --terapipe-edge-slices are mutually "
              "exclusive: give explicit slice lengths, a number of uniform slices, or edge "
              "slicing, one of them")
    if flags.edge_slices is not None:
        _check_edge_slices(run)
    seq = run.shape.seq_length
    if seq is None or seq <= 0:
        _fail(f"--pipeline-schedule terapipe needs a positive --seq-length (got {seq})")
    with as_flag_error():  # the slice lengths, as plan.SliceGrid checks them
        _check_slices(run, seq)
    _check_planner_flags(flags)
    _check_memory_flags(flags)
    group = run.shape.microbatch_group
    if group is not None and group < 1:
        _fail(f"--microbatch-group-size-per-virtual-pipeline-stage must be a positive number of "
              f"microbatches, got {group}")
    if flags.virtual_placement == "v":
        check_v_placement(run, args)
    problem = refusal(run.support)
    if problem:
        _fail(problem)
    return run


#: (Megatron-LM's arg, its flag, why a V cannot take it yet, the fix)
V_REFUSED = (
    ("mtp_num_layers", "--mtp-num-layers", "its MTP layers sit after the last virtual stage",
     "drop it or use --terapipe-virtual-placement ring"),
    ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split",
     "it moves a layer off the ring's first stage", "drop it"),
    ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split",
     "it moves a layer off the ring's last stage", "drop it"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout",
     "a V places whole chunks of equal layers", "drop it"),
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers",
     "a V places whole chunks of equal layers", "drop it"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers",
     "a V places whole chunks of equal layers", "drop it"),
)


def check_v_placement(run: RunSettings, args) -> None:
    """--terapipe-virtual-placement v: TeraPipe's schedule on 2 model chunks per rank of
    untied embeddings (model/v_layout.py builds and feeds them), and nothing a V cannot run."""
    if run.terapipe.schedule not in ("terapipe", "auto"):
        _fail(f"--terapipe-virtual-placement v runs TeraPipe's schedule (the schedule is "
              f"{run.terapipe.schedule}; Megatron has no V): add --pipeline-schedule terapipe "
              "or auto")
    chunks, stages = run.support.virtual_stages, run.shape.pipeline_parallel
    if chunks != 2 or stages < 2:
        _fail(f"--terapipe-virtual-placement v holds 2 model chunks per pipeline rank, on 2 or "
              f"more ranks (here {chunks} chunks, {stages} ranks): give "
              "--num-virtual-stages-per-pipeline-rank 2 and --pipeline-model-parallel-size 2 or "
              "more")
    problem = v_layout_problem(run, args)
    if problem:
        _fail(problem)


def v_layout_problem(run: RunSettings, args) -> str:
    """Why the rest of the flags cannot run 2 model chunks in a V, naming the flag and the fix;
    "" where they can (auto offers the V as a layout only then)."""
    if not run.model_state.untie_embeddings:
        return ("--terapipe-virtual-placement v runs with untied embedding and output weights "
                "(both sit on rank 0, in different chunks, and Megatron ties them across the "
                "ring's first and last ranks): add --untie-embeddings-and-output-weights")
    for name, flag, why, fix in V_REFUSED:
        if getattr(args, name, None):
            return f"--terapipe-virtual-placement v does not run with {flag} yet ({why}): {fix}"
    checkpoints = getattr(args, "save", None) or getattr(args, "load", None)
    if checkpoints and getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        return (f"--terapipe-virtual-placement v saves and loads checkpoints in the torch_dist "
                f"format (its layers by their place in the model, not by rank), not "
                f"--ckpt-format {args.ckpt_format}: use --ckpt-format torch_dist")
    return ""


def _check_slices(run: RunSettings, seq: int) -> None:
    """Explicit slices sum to the sequence (multiples of the TP size under sequence
    parallelism); the DP slicer and --terapipe-num-slices cut whole slice units."""
    flags, grid = run.terapipe, run.grid
    if flags.slices:
        if any(s <= 0 for s in flags.slices):
            _fail(f"--terapipe-slices must be positive token counts, got {list(flags.slices)}")
        grid.check_sum(flags.slices, seq)
        grid.check_tp_multiple([flags.slices])
    elif flags.num_slices is not None:
        grid.uniform(seq, flags.num_slices)
    else:
        grid.units(seq)


def _check_memory_flags(flags: TeraPipeSettings) -> None:
    for flag, value in (("--terapipe-memory-budget", flags.memory_budget),
                        ("--terapipe-model-state-memory", flags.model_state_memory)):
        if value is not None and (value < 0 or (value == 0 and flag == "--terapipe-memory-budget")):
            _fail(f"{flag} must be a positive size such as 70GiB, got {value:g} bytes")
    profile = flags.memory_profile
    if profile and not os.path.isfile(profile):
        _fail(f"--terapipe-memory-profile {profile}: no such file; measure one with python -m "
              "megatron_terapipe.megatron.measure memory, or drop the flag to use the cost "
              "model's estimate")


def _check_edge_slices(run: RunSettings) -> None:
    """--terapipe-edge-slices: counts (within the iteration's microbatches), the 1f1b order and
    one model chunk per rank."""
    first, n_first, last, n_last = run.terapipe.edge_slices
    if min(first, last) < 0 or min(n_first, n_last) < 1:
        _fail("--terapipe-edge-slices FIRST SLICES LAST LAST_SLICES takes microbatch counts of 0 "
              f"or more and slice counts of 1 or more, got {first} {n_first} {last} {n_last}")
    check_edge_microbatches(run.terapipe, run.shape)
    if run.terapipe.order != "1f1b":
        _fail("--terapipe-edge-slices runs whole sequences in the 1f1b order (it keeps K - k "
              "sequences in flight, as Megatron's 1F1B): use --terapipe-order 1f1b, or drop it")
    if run.support.virtual_stages > 1:
        _fail("--terapipe-edge-slices runs one model chunk per rank: drop "
              "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank, "
              "or give --terapipe-slices / --terapipe-num-slices for virtual stages")


def check_edge_microbatches(flags: TeraPipeSettings, shape: RunShape) -> None:
    """--terapipe-edge-slices cuts at most the microbatches an iteration has (first + last):
    with more, every microbatch would be cut as a first one, which is not what the flag says."""
    if flags.edge_slices is None:
        return
    first, _, last, _ = flags.edge_slices
    count = shape.num_microbatches
    if first + last <= count:
        return
    source = (f"--global-batch-size {shape.global_batch_size} / (--micro-batch-size "
              f"{shape.micro_batch_size} x data-parallel size {shape.data_parallel})"
              if shape.global_batch_size else "the script's --num-microbatches")
    raise TeraPipeArgumentError(
        f"--terapipe-edge-slices {' '.join(map(str, flags.edge_slices))}: the first and last "
        f"edge microbatches ({first} + {last}) exceed the {count} microbatches per iteration "
        f"({source}): give FIRST + LAST of at most {count}, or more microbatches per iteration")


def _check_auto(run: RunSettings) -> None:
    """--pipeline-schedule auto chooses among Megatron's schedules and TeraPipe itself (within
    the virtual pipeline stages the flags fix, when they fix them)."""
    if run.terapipe.slices_given:
        _fail("--pipeline-schedule auto plans the token slices itself: drop --terapipe-slices / "
              "--terapipe-num-slices / --terapipe-edge-slices, or use --pipeline-schedule "
              "terapipe")
    if run.shape.microbatch_group is not None:
        _fail("--pipeline-schedule auto chooses the microbatch groups of virtual pipeline stages "
              "itself: drop --microbatch-group-size-per-virtual-pipeline-stage, or keep it "
              "with --pipeline-schedule terapipe or 1f1b and virtual pipeline stages")


def _check_planner_flags(flags: TeraPipeSettings) -> None:
    cost = flags.cost_model
    if cost not in COST_MODELS and not os.path.isfile(cost):
        _fail(f"--terapipe-cost-model {cost!r} is neither 'analytic' nor 'profile' nor an "
              "existing layer-profile JSON file: give one of those (measure a profile with "
              "--terapipe-cost-model profile)")
    if flags.hardware not in HARDWARE_CHOICES:
        _fail(f"--terapipe-hardware must be one of {', '.join(HARDWARE_CHOICES)}, got "
              f"{flags.hardware!r}")
    trace = flags.trace
    if trace and not os.path.isdir(os.path.dirname(os.path.abspath(trace))):
        _fail(f"--terapipe-trace {trace}: directory {os.path.dirname(os.path.abspath(trace))} does "
              "not exist: create it or choose another path")
    if flags.profile_points < 2:
        _fail(f"--terapipe-profile-points must be at least 2, got {flags.profile_points}")
