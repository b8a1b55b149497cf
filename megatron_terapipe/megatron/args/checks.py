"""Checking the flags before any work: `validate_terapipe_args` parses them (settings.py) and
raises TeraPipeArgumentError, naming the flag and the fix, for what the TeraPipe schedule
cannot run."""

from __future__ import annotations

import os

from ..hooks.selection import (DROPOUT_GRAPHS, MOE_GRAPHS, attention_backend_problem,
                               dropout_values, moe_problem)
from .flags import COST_MODELS, HARDWARE_CHOICES, ORDERS
from .settings import RunSettings, TeraPipeArgumentError, TeraPipeSettings, as_flag_error

__all__ = ["TeraPipeArgumentError", "validate_terapipe_args"]


def _fail(message: str):
    raise TeraPipeArgumentError(message)


def validate_terapipe_args(args) -> RunSettings:
    """The flags as RunSettings, or TeraPipeArgumentError naming the flag and the fix for what
    TeraPipe cannot run. Reads Megatron-LM's argument names (seq_length,
    tensor_model_parallel_size, ...); attributes a script does not define count as unset. Runs
    before any work: no communication, no model."""
    run = RunSettings.from_args(args)
    flags = run.terapipe
    if not flags.selected and not flags.auto:
        given = flags.given_flags()
        if given:
            _fail(f"{given[0]} needs --pipeline-schedule terapipe or auto (the schedule is "
                  f"{flags.schedule}): add --pipeline-schedule terapipe or auto, or drop {given[0]}")
        return run
    if flags.auto:
        _check_auto(args, flags)
    if flags.order not in ORDERS:
        _fail(f"--terapipe-order must be one of {', '.join(ORDERS)}, got {flags.order!r}")
    if flags.slices and flags.num_slices is not None:
        _fail("--terapipe-slices and --terapipe-num-slices are mutually exclusive: give explicit "
              "slice lengths or a number of uniform slices, not both")
    seq = run.shape.seq_length
    if seq is None or seq <= 0:
        _fail(f"--pipeline-schedule terapipe needs a positive --seq-length (got {seq})")
    with as_flag_error():  # the slice lengths, as plan.SliceGrid checks them
        _check_slices(run, seq)
    _check_planner_flags(flags)
    _check_memory_flags(flags)
    _check_megatron_features(args, seq)
    _check_cuda_graphs(args)
    return run


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


def _check_cuda_graphs(args) -> None:
    if not getattr(args, "terapipe_cuda_graphs", False):
        return
    import torch

    if getattr(args, "overlap_grad_reduce", False):
        _fail("--terapipe-cuda-graphs replays the W actions without Python, so "
              "--overlap-grad-reduce would never see gradients ready: drop one of the two")
    if getattr(args, "num_experts", None):
        _fail(MOE_GRAPHS.format(option="--terapipe-cuda-graphs"))
    _check_dropout_rng(args)
    if getattr(args, "terapipe_cpu", False) or not torch.cuda.is_available():
        where = "--terapipe-cpu runs on CPU" if getattr(args, "terapipe_cpu", False) else \
            "this process sees no CUDA device"
        _fail(f"--terapipe-cuda-graphs captures cells as CUDA graphs, but {where}: drop "
              "--terapipe-cuda-graphs (on CPU, megatron_terapipe.runtime.graph_audit."
              "audit_iterations checks that cells could be captured)")


def _check_dropout_rng(args) -> None:
    """Dropout in CUDA graphs needs Megatron-LM's graph-safe RNG tracker: --te-rng-tracker, or
    the one --cuda-graph-impl makes (the schedule checks the tracker built at its first call)."""
    graph_safe = (getattr(args, "te_rng_tracker", False)
                  or getattr(args, "cuda_graph_impl", "none") not in (None, "none"))
    values = dropout_values(args)
    if values and not graph_safe:
        _fail(DROPOUT_GRAPHS.format(
            option="--terapipe-cuda-graphs", values=", ".join(values),
            fix="give --te-rng-tracker (Transformer Engine's tracker), or --hidden-dropout 0 "
                "--attention-dropout 0, or drop --terapipe-cuda-graphs"))


def _check_auto(args, flags: TeraPipeSettings) -> None:
    """--pipeline-schedule auto chooses among Megatron's schedules and TeraPipe itself."""
    if (getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None
            or getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None):
        _fail("--pipeline-schedule auto chooses the virtual pipeline stages itself: drop "
              "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank, "
              "or keep them with --pipeline-schedule 1f1b")
    if flags.slices_given:
        _fail("--pipeline-schedule auto plans the token slices itself: drop --terapipe-slices / "
              "--terapipe-num-slices, or use --pipeline-schedule terapipe")


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


def _check_megatron_features(args, seq: int) -> None:
    """Megatron-LM features the schedule cannot run."""
    if int(getattr(args, "context_parallel_size", 1) or 1) > 1:
        _fail(f"TeraPipe does not support context parallelism (--context-parallel-size "
              f"{args.context_parallel_size}): token slices already split the sequence; "
              "set --context-parallel-size 1, or use --pipeline-schedule 1f1b")
    if getattr(args, "hybrid_context_parallel", False):
        _fail("TeraPipe does not support --hybrid-context-parallel: drop it")
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if (getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None
            or getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None
            or (vp is not None and int(vp) > 1)):
        _fail("TeraPipe does not support virtual pipeline stages: drop "
              "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank "
              "(or use --pipeline-schedule 1f1b for Megatron's interleaved schedule)")
    if getattr(args, "num_experts", None):
        problem = moe_problem(args)
        if problem:
            _fail(problem)
    _check_unsupported_flags(args)
    decoder = getattr(args, "decoder_seq_length", None)
    if decoder is not None and int(decoder) != seq:
        _fail("TeraPipe supports decoder-only GPT models: unset --decoder-seq-length")
    if getattr(args, "defer_embedding_wgrad_compute", False):
        _fail("TeraPipe does not support --defer-embedding-wgrad-compute: drop it")
    if int(getattr(args, "tensor_model_parallel_size", 1) or 1) > 1 and getattr(args, "reset_attention_mask", False):
        _fail("TeraPipe with --tensor-model-parallel-size > 1 supports only the causal mask: "
              "drop --reset-attention-mask (it works with --tensor-model-parallel-size 1)")


#: Megatron-LM flags the schedule cannot run with when set: (attribute, message).
UNSUPPORTED = (
    ("mtp_num_layers", "TeraPipe does not support multi-token prediction: unset --mtp-num-layers"),
    ("use_legacy_models", "TeraPipe needs Megatron-Core models: drop --use-legacy-models"),
    ("multi_latent_attention",
     "TeraPipe does not support multi-latent attention yet: drop --multi-latent-attention"),
    ("experimental_attention_variant",
     "TeraPipe does not support --experimental-attention-variant: drop it"),
    ("window_size", "TeraPipe does not support sliding-window attention: drop --window-size"),
)


def _check_unsupported_flags(args) -> None:
    for name, message in UNSUPPORTED:
        if getattr(args, name, None):
            _fail(message)
    if getattr(args, "position_embedding_type", None) == "mrope":
        _fail("TeraPipe does not support --position-embedding-type mrope: use rope or "
              "learned_absolute")
    if getattr(args, "sft", False):
        _fail("TeraPipe does not support --sft (packed THD sequences): drop --sft")
    backend = getattr(args, "attention_backend", None)
    problem = attention_backend_problem("auto" if backend is None else str(getattr(backend, "name", backend)))
    if problem:
        _fail(problem)

