"""Checking the flags before any work: `validate_terapipe_args` raises TeraPipeArgumentError,
naming the flag and the fix, for what the TeraPipe schedule cannot run."""

from __future__ import annotations

import os

from ..hooks.selection import (DROPOUT_GRAPHS, MOE_GRAPHS, attention_backend_problem,
                               dropout_values, moe_problem)
from .flags import (COST_MODELS, DEFAULT_GRANULARITY, DEFAULT_PROFILE_POINTS, HARDWARE_CHOICES,
                    ORDERS, attention_backend, auto_selected, int_or_none, size_flag, slice_unit,
                    terapipe_selected, tp_size)


class TeraPipeArgumentError(ValueError):
    """A TeraPipe flag (or a Megatron-LM flag next to it) the schedule cannot run with."""


def _fail(message: str):
    raise TeraPipeArgumentError(message)


def validate_terapipe_args(args) -> None:
    """Raise TeraPipeArgumentError, naming the flag and the fix, for what TeraPipe cannot run.

    Reads Megatron-LM's argument names (seq_length, tensor_model_parallel_size, ...); attributes
    a script does not define count as unset. Runs before any work: no communication, no model.
    """
    slices = getattr(args, "terapipe_slices", None)
    num_slices = getattr(args, "terapipe_num_slices", None)
    if not terapipe_selected(args) and not auto_selected(args):
        given = [flag for flag, value in (("--terapipe-slices", slices),
                                          ("--terapipe-num-slices", num_slices),
                                          ("--terapipe-memory-budget", _memory_flag(args)))
                 if value not in (None, [], ())]
        if getattr(args, "terapipe_cuda_graphs", False):
            given.append("--terapipe-cuda-graphs")
        if given:
            _fail(f"{given[0]} needs --pipeline-schedule terapipe or auto (the schedule is "
                  f"{getattr(args, 'pipeline_schedule', '1f1b')}): add --pipeline-schedule "
                  f"terapipe or auto, or drop {given[0]}")
        return
    if auto_selected(args):
        _check_auto(args)
    if getattr(args, "terapipe_order", "1f1b") not in ORDERS:
        _fail(f"--terapipe-order must be one of {', '.join(ORDERS)}, got {args.terapipe_order!r}")
    if slices and num_slices is not None:
        _fail("--terapipe-slices and --terapipe-num-slices are mutually exclusive: give explicit "
              "slice lengths or a number of uniform slices, not both")
    seq = int_or_none(getattr(args, "seq_length", None))
    if seq is None or seq <= 0:
        _fail(f"--pipeline-schedule terapipe needs a positive --seq-length (got {seq})")
    granularity = getattr(args, "terapipe_granularity", DEFAULT_GRANULARITY)
    if granularity is None or int(granularity) <= 0:
        _fail(f"--terapipe-granularity must be a positive number of tokens, got {granularity}")
    if slices:
        _check_explicit_slices(args, slices, seq)
    else:
        _check_slice_unit(args, num_slices, seq, int(granularity))
    _check_planner_flags(args)
    _check_memory_flags(args)
    _check_megatron_features(args, seq)
    _check_cuda_graphs(args)


def _memory_flag(args):
    return getattr(args, "terapipe_memory_budget", None)


def _check_memory_flags(args) -> None:
    for name in ("terapipe_memory_budget", "terapipe_model_state_memory"):
        flag = "--" + name.replace("_", "-")
        try:
            value = size_flag(args, name)
        except ValueError as exc:
            _fail(f"{flag}: {exc}")
        if value is not None and (value < 0 or (value == 0 and name == "terapipe_memory_budget")):
            _fail(f"{flag} must be a positive size such as 70GiB, got {getattr(args, name)!r}")
    profile = getattr(args, "terapipe_memory_profile", None)
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


def _check_auto(args) -> None:
    """--pipeline-schedule auto chooses among Megatron's schedules and TeraPipe itself."""
    if (getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None
            or getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None):
        _fail("--pipeline-schedule auto chooses the virtual pipeline stages itself: drop "
              "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank, "
              "or keep them with --pipeline-schedule 1f1b")
    if getattr(args, "terapipe_slices", None) or getattr(args, "terapipe_num_slices", None):
        _fail("--pipeline-schedule auto plans the token slices itself: drop --terapipe-slices / "
              "--terapipe-num-slices, or use --pipeline-schedule terapipe")


def _check_explicit_slices(args, slices, seq: int) -> None:
    if any(int(s) <= 0 for s in slices):
        _fail(f"--terapipe-slices must be positive token counts, got {list(slices)}")
    if sum(slices) != seq:
        _fail(f"--terapipe-slices {' '.join(map(str, slices))} sum to {sum(slices)} tokens but "
              f"--seq-length is {seq}: give lengths that sum to {seq}")
    tp = tp_size(args)
    if getattr(args, "sequence_parallel", False) and tp > 1:
        bad = [s for s in slices if s % tp]
        if bad:
            _fail(f"--terapipe-slices {bad} are not multiples of --tensor-model-parallel-size "
                  f"{tp}, which --sequence-parallel requires: use multiples of {tp}")


def _check_slice_unit(args, num_slices, seq: int, granularity: int) -> None:
    """The DP slicer and --terapipe-num-slices cut in units of slice_unit(args) tokens."""
    unit = slice_unit(args)
    if seq % unit:
        what = (f"--terapipe-granularity {granularity}" if unit == granularity else
                f"the least common multiple {unit} of --terapipe-granularity {granularity} and "
                f"--tensor-model-parallel-size {tp_size(args)} (--sequence-parallel)")
        _fail(f"--seq-length {seq} is not a multiple of {what}: choose a "
              f"--terapipe-granularity that divides {seq}")
    if num_slices is None:
        return
    if int(num_slices) <= 0:
        _fail(f"--terapipe-num-slices must be a positive number of slices, got {num_slices}")
    if int(num_slices) > seq // unit:
        _fail(f"--terapipe-num-slices {num_slices} is more than --seq-length {seq} / "
              f"{unit}-token units = {seq // unit} slices: use at most {seq // unit}, or a "
              "smaller --terapipe-granularity")


def _check_planner_flags(args) -> None:
    cost = getattr(args, "terapipe_cost_model", "analytic") or "analytic"
    if cost not in COST_MODELS and not os.path.isfile(cost):
        _fail(f"--terapipe-cost-model {cost!r} is neither 'analytic' nor 'profile' nor an "
              "existing layer-profile JSON file: give one of those (measure a profile with "
              "--terapipe-cost-model profile)")
    hardware = getattr(args, "terapipe_hardware", "auto")
    if hardware not in HARDWARE_CHOICES:
        _fail(f"--terapipe-hardware must be one of {', '.join(HARDWARE_CHOICES)}, got {hardware!r}")
    trace = getattr(args, "terapipe_trace", None)
    if trace and not os.path.isdir(os.path.dirname(os.path.abspath(trace))):
        _fail(f"--terapipe-trace {trace}: directory {os.path.dirname(os.path.abspath(trace))} does "
              "not exist: create it or choose another path")
    points = getattr(args, "terapipe_profile_points", DEFAULT_PROFILE_POINTS)
    if points is None or int(points) < 2:
        _fail(f"--terapipe-profile-points must be at least 2, got {points}")


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
    if tp_size(args) > 1 and getattr(args, "reset_attention_mask", False):
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
    problem = attention_backend_problem(attention_backend(args))
    if problem:
        _fail(problem)

