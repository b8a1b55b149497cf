"""Megatron-LM style command-line flags for TeraPipe, and the plan they select.

`add_terapipe_args(parser)` works as Megatron-LM's `extra_args_provider` (combine it with a
script's own provider with `combine_extra_args`). `validate_terapipe_args(args)` rejects what the
schedule cannot run, naming the flag and the fix, before any work. `ArgsPlanProvider` turns the
parsed flags into a plan the first time the schedule runs for a given shape (the config-time
hook): rank 0 chooses it and broadcasts it, so every rank runs the identical plan.
`setup_from_args(args)` validates, selects TeraPipe for `get_forward_backward_func` and installs
the hooks; the launcher (`python -m megatron_terapipe.megatron.launch`) calls it for Megatron-LM scripts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from ..plan import TeraPipePlan

SCHEDULES = ("1f1b", "terapipe")
ORDERS = ("1f1b", "gpipe")
COST_MODELS = ("analytic", "profile")
HARDWARE_CHOICES = ("auto", "v100", "a100", "h100")
DEFAULT_GRANULARITY = 8
DEFAULT_PROFILE_POINTS = 4


class TeraPipeArgumentError(ValueError):
    """A TeraPipe flag (or a Megatron-LM flag next to it) the schedule cannot run with."""


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------
def add_terapipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the TeraPipe flags to a Megatron-LM (or any argparse) parser and return it.

    Usable as Megatron-LM's `extra_args_provider`. Adding them twice is harmless.
    """
    if "--pipeline-schedule" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(title="terapipe")
    group.add_argument("--pipeline-schedule", choices=SCHEDULES, default="1f1b",
                       help="1f1b: Megatron's own schedule (interleaved with virtual stages); "
                            "terapipe: token-slice pipelining (TeraPipe)")
    group.add_argument("--terapipe-order", choices=ORDERS, default="1f1b",
                       help="order of cells: 1f1b (low memory) or gpipe (the paper's order)")
    slices = group.add_mutually_exclusive_group()
    slices.add_argument("--terapipe-slices", type=int, nargs="+", default=None, metavar="TOKENS",
                        help="explicit token slice lengths, summing to --seq-length")
    slices.add_argument("--terapipe-num-slices", type=int, default=None, metavar="N",
                        help="cut each sequence into N near-equal slices (multiples of "
                             "--terapipe-granularity)")
    group.add_argument("--terapipe-defer-wgrad", choices=("auto", "on", "off"), default="auto",
                       help="compute each sequence's weight gradients in one W action after its "
                            "last backward cell instead of in every cell (auto: when the cost "
                            "model's simulation finds it at least 1%% faster)")
    group.add_argument("--terapipe-cost-model", default="analytic",
                       metavar="{analytic,profile,PATH}",
                       help="cost model of the DP slicer (used when no slices are given) and of "
                            "the logged prediction: analytic (model shape + --terapipe-hardware), "
                            "profile (measure a layer on this device once, cached in "
                            "--terapipe-cache-dir), or a layer-profile JSON file")
    group.add_argument("--terapipe-hardware", choices=HARDWARE_CHOICES, default="auto",
                       help="GPU preset of the analytic cost model (auto: from the device name)")
    group.add_argument("--terapipe-granularity", type=int, default=DEFAULT_GRANULARITY,
                       metavar="TOKENS", help="slice lengths are multiples of this many tokens")
    group.add_argument("--terapipe-cache-dir", default=None, metavar="DIR",
                       help="where measured layer profiles are cached (default: "
                            "$XDG_CACHE_HOME/megatron_terapipe or ~/.cache/megatron_terapipe)")
    group.add_argument("--terapipe-profile-points", type=int, default=DEFAULT_PROFILE_POINTS,
                       metavar="N", help="slice lengths and contexts measured per axis with "
                                         "--terapipe-cost-model profile (keep it small)")
    group.add_argument("--terapipe-trace", default=None, metavar="PATH",
                       help="write Chrome traces: the simulated plan to PATH's "
                            "'.simulated.json' sibling, the measured second iteration to PATH")
    return parser


def combine_extra_args(*providers: Optional[Callable]) -> Callable:
    """One `extra_args_provider` that applies each of `providers` in turn (None skipped).

    E.g. `pretrain(..., extra_args_provider=combine_extra_args(my_args, add_terapipe_args))`.
    """
    chain = [p for p in providers if p is not None]

    def provider(parser):
        for p in chain:
            result = p(parser)
            parser = parser if result is None else result
        return parser

    provider.providers = tuple(chain)  # type: ignore[attr-defined]
    return provider


def terapipe_selected(args) -> bool:
    return getattr(args, "pipeline_schedule", "1f1b") == "terapipe"


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _fail(message: str):
    raise TeraPipeArgumentError(message)


def _int_or_none(value) -> Optional[int]:
    return None if value is None else int(value)


def slice_unit(args) -> int:
    """Tokens every slice length is a multiple of: the granularity, and the TP size under SP."""
    granularity = int(getattr(args, "terapipe_granularity", DEFAULT_GRANULARITY) or 1)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    multiple = tp if getattr(args, "sequence_parallel", False) else 1
    return granularity * multiple // math.gcd(granularity, multiple)


def validate_terapipe_args(args) -> None:
    """Raise TeraPipeArgumentError, naming the flag and the fix, for what TeraPipe cannot run.

    Reads Megatron-LM's argument names (seq_length, tensor_model_parallel_size, ...); attributes
    a script does not define count as unset. Runs before any work: no communication, no model.
    """
    slices = getattr(args, "terapipe_slices", None)
    num_slices = getattr(args, "terapipe_num_slices", None)
    if not terapipe_selected(args):
        if slices or num_slices is not None:
            flag = "--terapipe-slices" if slices else "--terapipe-num-slices"
            _fail(f"{flag} needs --pipeline-schedule terapipe (the schedule is "
                  f"{getattr(args, 'pipeline_schedule', '1f1b')}): add --pipeline-schedule terapipe "
                  f"or drop {flag}")
        return

    # ---- the TeraPipe flags themselves ----
    if getattr(args, "terapipe_order", "1f1b") not in ORDERS:
        _fail(f"--terapipe-order must be one of {', '.join(ORDERS)}, got {args.terapipe_order!r}")
    if slices and num_slices is not None:
        _fail("--terapipe-slices and --terapipe-num-slices are mutually exclusive: give explicit "
              "slice lengths or a number of uniform slices, not both")
    seq = _int_or_none(getattr(args, "seq_length", None))
    if seq is None or seq <= 0:
        _fail(f"--pipeline-schedule terapipe needs a positive --seq-length (got {seq})")
    granularity = getattr(args, "terapipe_granularity", DEFAULT_GRANULARITY)
    if granularity is None or int(granularity) <= 0:
        _fail(f"--terapipe-granularity must be a positive number of tokens, got {granularity}")
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    sp = bool(getattr(args, "sequence_parallel", False))
    if slices:
        bad = [s for s in slices if int(s) <= 0]
        if bad:
            _fail(f"--terapipe-slices must be positive token counts, got {list(slices)}")
        if sum(slices) != seq:
            _fail(f"--terapipe-slices {' '.join(map(str, slices))} sum to {sum(slices)} tokens but "
                  f"--seq-length is {seq}: give lengths that sum to {seq}")
        if sp and tp > 1:
            bad = [s for s in slices if s % tp]
            if bad:
                _fail(f"--terapipe-slices {bad} are not multiples of --tensor-model-parallel-size "
                      f"{tp}, which --sequence-parallel requires: use multiples of {tp}")
    else:
        unit = slice_unit(args)
        if seq % unit:
            what = (f"--terapipe-granularity {granularity}" if unit == int(granularity) else
                    f"the least common multiple {unit} of --terapipe-granularity {granularity} and "
                    f"--tensor-model-parallel-size {tp} (--sequence-parallel)")
            _fail(f"--seq-length {seq} is not a multiple of {what}: choose a "
                  f"--terapipe-granularity that divides {seq}")
        if num_slices is not None:
            if int(num_slices) <= 0:
                _fail(f"--terapipe-num-slices must be a positive number of slices, got {num_slices}")
            if int(num_slices) > seq // unit:
                _fail(f"--terapipe-num-slices {num_slices} is more than --seq-length {seq} / "
                      f"{unit}-token units = {seq // unit} slices: use at most {seq // unit}, or a "
                      "smaller --terapipe-granularity")
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

    # ---- Megatron-LM features the schedule cannot run ----
    if int(getattr(args, "context_parallel_size", 1) or 1) > 1:
        _fail(f"TeraPipe does not support context parallelism (--context-parallel-size "
              f"{args.context_parallel_size}): token slices already split the sequence; "
              "set --context-parallel-size 1")
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
        _fail(f"TeraPipe does not support MoE models yet (--num-experts {args.num_experts}): "
              "unset --num-experts or use --pipeline-schedule 1f1b")
    if getattr(args, "mtp_num_layers", None):
        _fail("TeraPipe does not support multi-token prediction: unset --mtp-num-layers")
    if getattr(args, "use_legacy_models", False):
        _fail("TeraPipe needs Megatron-Core models: drop --use-legacy-models")
    if getattr(args, "multi_latent_attention", False):
        _fail("TeraPipe does not support multi-latent attention yet: drop --multi-latent-attention")
    if getattr(args, "experimental_attention_variant", None):
        _fail("TeraPipe does not support --experimental-attention-variant: drop it")
    if getattr(args, "window_size", None):
        _fail("TeraPipe does not support sliding-window attention: drop --window-size")
    if getattr(args, "position_embedding_type", None) == "mrope":
        _fail("TeraPipe does not support --position-embedding-type mrope: use rope or "
              "learned_absolute")
    if getattr(args, "sft", False):
        _fail("TeraPipe does not support --sft (packed THD sequences): drop --sft")
    decoder = getattr(args, "decoder_seq_length", None)
    if decoder is not None and int(decoder) != seq:
        _fail("TeraPipe supports decoder-only GPT models: unset --decoder-seq-length")
    if getattr(args, "defer_embedding_wgrad_compute", False):
        _fail("TeraPipe does not support --defer-embedding-wgrad-compute: drop it")
    if tp > 1 and getattr(args, "reset_attention_mask", False):
        _fail("TeraPipe with --tensor-model-parallel-size > 1 supports only the causal mask: "
              "drop --reset-attention-mask (it works with --tensor-model-parallel-size 1)")


# ---------------------------------------------------------------------------------------------
# Cost models from flags
# ---------------------------------------------------------------------------------------------
def model_dims_from_args(args):
    """The planner's ModelDims from Megatron-LM's model flags."""
    from ..planner import ModelDims

    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    try:
        return ModelDims(num_layers=int(args.num_layers), hidden_size=int(args.hidden_size),
                         num_attention_heads=int(args.num_attention_heads),
                         ffn_hidden_size=_int_or_none(getattr(args, "ffn_hidden_size", None)),
                         num_query_groups=_int_or_none(groups),
                         gated_linear_unit=bool(getattr(args, "swiglu", False)),
                         # Megatron-LM pads the tokenizer's vocabulary (padded_vocab_size);
                         # scripts without a tokenizer give --vocab-size. It prices the embedding
                         # and the output layer (edge costs); unknown means none.
                         vocab_size=_int_or_none(getattr(args, "padded_vocab_size", None)
                                                 or getattr(args, "vocab_size", None)),
                         name="this model")
    except AttributeError as exc:
        raise TeraPipeArgumentError(
            f"planning needs the model shape (--num-layers, --hidden-size, --num-attention-heads): "
            f"{exc}; or give --terapipe-slices / --terapipe-num-slices") from None


def _pp_size(args) -> int:
    return int(getattr(args, "pipeline_model_parallel_size", 1) or 1)


def _tp_size(args) -> int:
    return int(getattr(args, "tensor_model_parallel_size", 1) or 1)


def layers_per_stage(args) -> int:
    return max(1, math.ceil(int(args.num_layers) / _pp_size(args)))


def data_parallel_size(args) -> int:
    dp = getattr(args, "data_parallel_size", None)
    if dp:
        return int(dp)
    world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", 1))
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    return max(1, world // (_tp_size(args) * _pp_size(args) * cp))


def num_microbatches(args, micro_batch_size: int) -> int:
    """Microbatches per iteration: --num-microbatches if the script has it, else from the
    global batch size (Megatron-LM: global / (micro x data parallel))."""
    n = getattr(args, "num_microbatches", None)
    if n:
        return int(n)
    gbs = getattr(args, "global_batch_size", None)
    if gbs:
        return max(1, int(gbs) // (micro_batch_size * data_parallel_size(args)))
    return 1


def _dtype_bytes(args) -> int:
    return 2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4


def _dtype_name(args) -> str:
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        try:
            return torch.cuda.get_device_name()
        except Exception:  # pragma: no cover
            return "cuda"
    return f"cpu ({platform.machine()}, {platform.processor() or 'unknown'})"


def hardware_from_args(args) -> tuple[Any, str]:
    """The analytic model's GPU preset, and a note when it had to be guessed."""
    from ..planner import hardware_preset

    name = getattr(args, "terapipe_hardware", "auto") or "auto"
    if name != "auto":
        return hardware_preset(name), ""
    device = device_name().lower()
    for preset in ("h100", "a100", "v100"):
        if preset in device:
            return hardware_preset(preset), ""
    return hardware_preset("a100"), f"device '{device_name()}' has no preset; assuming a100"


def _inter_node(args) -> bool:
    """Whether neighbouring pipeline stages sit on different nodes (Megatron's default rank order
    puts TP, CP and DP ranks between them)."""
    world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world <= local:
        return False
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    return _tp_size(args) * cp * data_parallel_size(args) >= local


def analytic_cost_model(args):
    from ..planner import AnalyticCostModel

    hardware, note = hardware_from_args(args)
    model = AnalyticCostModel(model_dims_from_args(args), hardware, layers_per_stage(args),
                              tensor_parallel=_tp_size(args), dtype_bytes=_dtype_bytes(args),
                              inter_node=_inter_node(args))
    return model, note


def _link(args):
    hardware, _ = hardware_from_args(args)
    return hardware.inter_node if _inter_node(args) else hardware.intra_node


def profiled_cost_model_from_file(args, path: str):
    from ..planner import ProfiledCostModel

    try:
        return ProfiledCostModel.load(path, layers_per_stage(args), _link(args),
                                      model=model_dims_from_args(args),
                                      tensor_parallel=_tp_size(args), dtype_bytes=_dtype_bytes(args))
    except ValueError as exc:
        raise TeraPipeArgumentError(f"--terapipe-cost-model {path}: {exc}") from None


# ---- measured profiles, cached on disk --------------------------------------------------------
def cache_dir(args) -> Path:
    explicit = getattr(args, "terapipe_cache_dir", None)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_terapipe"


def profile_cache_key(args, seq_length: int, micro_batch_size: int) -> dict:
    """What a measured profile depends on: model shape, parallelism, grid, device, versions."""
    import torch

    try:
        from megatron.core import __version__ as mcore_version
    except Exception:  # pragma: no cover
        mcore_version = "unknown"
    from .. import __version__

    return {
        "model": model_dims_from_args(args).to_dict() | {"num_layers": None},
        "tensor_parallel": _tp_size(args),
        "sequence_parallel": bool(getattr(args, "sequence_parallel", False)),
        "dtype": _dtype_name(args),
        "seq_length": int(seq_length),
        "micro_batch_size": int(micro_batch_size),
        "granularity": int(getattr(args, "terapipe_granularity", DEFAULT_GRANULARITY)),
        "points": int(getattr(args, "terapipe_profile_points", DEFAULT_PROFILE_POINTS)),
        "device": device_name(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "megatron.core": mcore_version, "megatron_terapipe": __version__,
                     "python": platform.python_version()},
    }


def profile_cache_path(args, seq_length: int, micro_batch_size: int) -> Path:
    key = profile_cache_key(args, seq_length, micro_batch_size)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(args) / f"layer-profile-{digest}.json"


def profile_cells(args, seq_length: int, micro_batch_size: int) -> list[tuple[int, int, int]]:
    """The (batch, length, context) cells to measure: a small grid over the run's shapes."""
    from ..planner.profiled import default_grid

    unit = slice_unit(args)
    sizes = sorted({b for b in (1, micro_batch_size) if micro_batch_size % b == 0})
    points = int(getattr(args, "terapipe_profile_points", DEFAULT_PROFILE_POINTS))
    return default_grid(seq_length, sizes, granularity=unit, points=points)


def default_measure(args, cells: list[tuple[int, int, int]]):
    """Measure one layer of this model on this device (every rank runs it; see plan_for).

    Uses the planner's measure_layer_times: Megatron's GPT layer with slice-aware attention on
    real token slices, tensor-parallel as the run is.
    """
    from .measure import measure_layer_times

    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(_dtype_name(args), "float32")
    return measure_layer_times(model_dims_from_args(args), cells, dtype=dtype,
                               repeats=2, warmup=1, progress=_rank() == 0,
                               position_embedding_type=getattr(args, "position_embedding_type",
                                                               None) or "learned_absolute")


def fit_measurements(args, measurements, seq_length: int, micro_batch_size: int):
    from ..planner import fit_layer_times

    measurements.metadata.setdefault("model", model_dims_from_args(args).to_dict())
    measurements.metadata.setdefault("tensor_parallel", _tp_size(args))
    measurements.metadata.setdefault("device", device_name())
    measurements.metadata.setdefault("dtype", _dtype_name(args))
    measurements.metadata["cache_key"] = profile_cache_key(args, seq_length, micro_batch_size)
    return fit_layer_times(measurements)


# ---------------------------------------------------------------------------------------------
# Plans from flags
# ---------------------------------------------------------------------------------------------
def _distributed():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _distributed()
    return dist.get_rank() if dist is not None else 0


def _broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (identity without torch.distributed)."""
    dist = _distributed()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _with_rng_kept(fn: Callable[[], Any]) -> Any:
    """Run `fn` (which builds and runs a layer) without moving this rank's random streams:
    torch's CPU and CUDA generators and Megatron's model-parallel RNG tracker come back as they
    were (the measurement seeds and replaces the tracker)."""
    import torch

    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        from megatron.core.tensor_parallel import random as tp_random
    except ImportError:  # pragma: no cover
        tp_random = None
    saved_tracker = None
    if tp_random is not None:
        tracker = tp_random._CUDA_RNG_STATE_TRACKER
        states = None
        if tracker is not None:
            try:
                states = tracker.get_states()
            except Exception:  # pragma: no cover
                states = None
        saved_tracker = (tracker, tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED, states)
    try:
        return fn()
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if saved_tracker is not None:
            tracker, initialized, states = saved_tracker
            tp_random._CUDA_RNG_STATE_TRACKER = tracker
            tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = initialized
            if tracker is not None and states is not None:
                try:
                    tracker.set_states(states)
                except Exception:  # pragma: no cover
                    pass


@dataclass
class PlanReport:
    """What rank 0 logs about a plan: where it came from and what the simulator predicts."""

    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    num_stages: int
    source: str
    cost_model: str
    iteration_time: Optional[float] = None
    bubble: Optional[float] = None
    baseline_time: Optional[float] = None
    baseline_bubble: Optional[float] = None
    notes: list[str] = field(default_factory=list)

    def lines(self, plan: TeraPipePlan) -> list[str]:
        out = [f"> terapipe plan for seq_length {self.seq_length}, micro_batch_size "
               f"{self.micro_batch_size}, {self.num_microbatches} microbatches, "
               f"{self.num_stages} pipeline stages:"]
        rows = plan.batch_slices or (None,)
        for r, ts in zip(rows, plan.token_slices):
            who = f"{r} rows" if r is not None else "all rows"
            out.append(f">   token slices ({who}) ... {' '.join(map(str, ts))}")
        out.append(f">   order ..................... {plan.order}")
        wgrad = "deferred: one W action per sequence" if plan.defer_wgrad else "in every backward cell"
        if plan.wgrad_points:
            wgrad += f"; {plan.early_w_text()}"
        out.append(">   weight gradients .......... " + wgrad)
        out.append(f">   slices from ............... {self.source}")
        out.append(f">   cost model ................ {self.cost_model}")
        if self.iteration_time is not None:
            line = f">   predicted iteration ....... {self.iteration_time * 1e3:.3f} ms"
            if self.baseline_time:
                line += (f" (1F1B without token slices: {self.baseline_time * 1e3:.3f} ms, "
                         f"{self.baseline_time / max(self.iteration_time, 1e-30):.2f}x)")
            out.append(line)
        if self.bubble is not None:
            line = f">   pipeline bubble ........... {100 * self.bubble:.1f}%"
            if self.baseline_bubble is not None:
                line += f" (1F1B without token slices: {100 * self.baseline_bubble:.1f}%)"
            out.append(line)
        out.extend(f">   note: {n}" for n in self.notes)
        return out


@dataclass
class ArgsPlanProvider:
    """Plans from parsed flags, one per (seq_length, micro_batch_size), computed once.

    `plan_for` is called by the schedule on every rank at the same time (all ranks run it);
    rank 0 chooses the plan and broadcasts it, so every rank gets the identical plan. A
    measured profile is measured on every rank at once (tensor-parallel layers need all their
    ranks, and nobody waits in a collective while others measure), fitted and cached by rank 0.
    `measure(args, cells)` returns LayerMeasurements (tests pass their own).
    """

    args: argparse.Namespace
    plans: dict[tuple[int, int], TeraPipePlan] = field(default_factory=dict)
    reports: dict[tuple[int, int], PlanReport] = field(default_factory=dict)
    measure: Optional[Callable] = None
    log: bool = True
    measurements: int = 0  # layer profiles measured by this process
    cache_hits: int = 0

    def plan_for(self, seq_length: int, micro_batch_size: int) -> TeraPipePlan:
        key = (int(seq_length), int(micro_batch_size))
        if key not in self.plans:
            self.plans[key] = self._choose(*key)
        return self.plans[key]

    # -- the collective protocol: every rank runs exactly these steps ------------------------
    def _choose(self, seq_length: int, micro_batch_size: int) -> TeraPipePlan:
        rank = _rank()
        fit = None
        if self._wants_profile():
            decision: dict[str, Any] = {}
            if rank == 0:
                decision = _guard(lambda: self._profile_decision(seq_length, micro_batch_size))
            decision = _broadcast(decision)
            _raise_if_error(decision)
            if decision["measure"]:
                outcome = _guard(lambda: {"fit": self._measure(seq_length, micro_batch_size)})
                statuses = _all_gather({"error": outcome.get("error")})
                errors = [s["error"] for s in statuses if s.get("error")]
                if errors:
                    raise TeraPipeArgumentError(errors[0])
                fit = outcome["fit"]
                if rank == 0:
                    path = Path(decision["path"])
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(f".tmp{os.getpid()}")
                    fit.save(tmp)
                    os.replace(tmp, path)
            else:
                self.cache_hits += 1
        payload: dict[str, Any] = {}
        if rank == 0:
            payload = _guard(lambda: self._plan_payload(seq_length, micro_batch_size, fit))
        payload = _broadcast(payload)
        _raise_if_error(payload)
        plan = TeraPipePlan.from_dict(payload["plan"])
        report = PlanReport(**payload["report"])
        self.reports[(seq_length, micro_batch_size)] = report
        if rank == 0 and self.log:
            for line in report.lines(plan):
                print(line, flush=True)
        return plan

    def _wants_profile(self) -> bool:
        a = self.args
        return (getattr(a, "terapipe_cost_model", "analytic") == "profile"
                and not getattr(a, "terapipe_slices", None)
                and getattr(a, "terapipe_num_slices", None) is None)

    def _profile_decision(self, seq_length: int, micro_batch_size: int) -> dict:
        path = profile_cache_path(self.args, seq_length, micro_batch_size)
        if path.is_file():
            try:
                from ..planner import LayerTimeFit

                # an entry in an older format is measured again and overwritten, as an
                # unreadable one
                if LayerTimeFit.load(path).is_current_format:
                    return {"measure": False, "path": str(path)}
            except ValueError:
                pass
        return {"measure": True, "path": str(path)}

    def _measure(self, seq_length: int, micro_batch_size: int):
        cells = profile_cells(self.args, seq_length, micro_batch_size)
        if _rank() == 0 and self.log:
            print(f"> terapipe: measuring one layer on {device_name()} ({len(cells)} cells, "
                  "once; cached for later starts)", flush=True)
        measure = self.measure or default_measure
        measurements = _with_rng_kept(lambda: measure(self.args, cells))
        self.measurements += 1
        return fit_measurements(self.args, measurements, seq_length, micro_batch_size)

    def cost_model(self, seq_length: int, micro_batch_size: int, fit=None) -> tuple[Any, list[str]]:
        """The cost model the flags name (rank 0 side), with notes for the log."""
        choice = getattr(self.args, "terapipe_cost_model", "analytic") or "analytic"
        if choice == "analytic":
            model, note = analytic_cost_model(self.args)
            return model, [note] if note else []
        if choice == "profile":
            from ..planner import LayerTimeFit, ProfiledCostModel

            if fit is None:
                path = profile_cache_path(self.args, seq_length, micro_batch_size)
                if not path.is_file():  # explicit slices: the prediction uses the analytic model
                    model, note = analytic_cost_model(self.args)
                    return model, ([note] if note else []) + [
                        "no measured profile for this shape yet; prediction from the analytic model"]
                fit = LayerTimeFit.load(path)
            model = ProfiledCostModel(fit, layers_per_stage(self.args), _link(self.args),
                                      model=model_dims_from_args(self.args),
                                      tensor_parallel=_tp_size(self.args),
                                      dtype_bytes=_dtype_bytes(self.args))
            return model, []
        return profiled_cost_model_from_file(self.args, choice), []

    def _plan_payload(self, seq_length: int, micro_batch_size: int, fit) -> dict:
        plan, report = plan_and_report(self.args, seq_length, micro_batch_size,
                                       cost=lambda: self.cost_model(seq_length, micro_batch_size, fit))
        trace = getattr(self.args, "terapipe_trace", None)
        if trace and report.iteration_time is not None:
            try:
                _write_simulated_trace(self.args, plan, seq_length, micro_batch_size,
                                       self.cost_model(seq_length, micro_batch_size, fit)[0], trace)
            except OSError as exc:  # a trace is a by-product: training goes on without it
                report.notes.append(f"could not write the simulated trace: {exc}")
        return {"plan": plan.to_dict(), "report": report.__dict__}


def _guard(fn: Callable[[], dict]) -> dict:
    """Run `fn`; an error becomes {'error': message} so that every rank can raise it."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - every rank must learn of rank 0's failure
        return {"error": f"{exc}" if isinstance(exc, TeraPipeArgumentError)
                else f"{type(exc).__name__}: {exc}"}


def _raise_if_error(payload: dict) -> None:
    if payload.get("error"):
        raise TeraPipeArgumentError(payload["error"])


def _all_gather(obj: Any) -> list[Any]:
    dist = _distributed()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def simulated_schedule(args, plan: TeraPipePlan, seq_length: int, micro_batch_size: int):
    from ..schedule import build_schedule

    return build_schedule(plan, num_microbatches(args, micro_batch_size), _pp_size(args),
                          micro_batch_size)


def _write_simulated_trace(args, plan, seq_length, micro_batch_size, cost, path: str) -> None:
    from ..planner import simulate, write_chrome_trace

    result = simulate(simulated_schedule(args, plan, seq_length, micro_batch_size), cost)
    write_chrome_trace(result, simulated_trace_path(path))


def simulated_trace_path(path: str) -> Path:
    p = Path(path)
    return p.with_name(p.stem + ".simulated" + (p.suffix or ".json"))


def plan_and_report(args, seq_length: int, micro_batch_size: int,
                    cost: Optional[Callable[[], tuple[Any, list[str]]]] = None
                    ) -> tuple[TeraPipePlan, PlanReport]:
    """The plan the flags select for this shape, and the simulator's view of it (one process)."""
    order = getattr(args, "terapipe_order", "1f1b")
    K = _pp_size(args)
    M = num_microbatches(args, micro_batch_size)
    cost = cost or (lambda: (lambda m: (m[0], [m[1]] if m[1] else []))(analytic_cost_model(args)))
    slices = getattr(args, "terapipe_slices", None)
    num_slices = getattr(args, "terapipe_num_slices", None)
    defer = getattr(args, "terapipe_defer_wgrad", "auto")
    planned = not slices and num_slices is None
    model = None
    notes: list[str] = []
    if slices:
        if sum(slices) != seq_length:
            raise TeraPipeArgumentError(
                f"--terapipe-slices {' '.join(map(str, slices))} sum to {sum(slices)} tokens but "
                f"the sequence has {seq_length}: give lengths that sum to {seq_length}")
        plan = TeraPipePlan(seq_slices=list(slices), order=order)
        source = "--terapipe-slices"
    elif num_slices is not None:
        unit = slice_unit(args)
        if seq_length % unit or num_slices > seq_length // unit:
            raise TeraPipeArgumentError(
                f"--terapipe-num-slices {num_slices} cannot cut {seq_length} tokens into slices of "
                f"multiples of {unit} tokens (--terapipe-granularity): use at most "
                f"{max(1, seq_length // unit)} slices or a granularity that divides {seq_length}")
        plan = TeraPipePlan.uniform(seq_length, int(num_slices), order=order, multiple_of=unit)
        source = f"--terapipe-num-slices {num_slices} (uniform)"
    else:
        from ..planner import solve

        model, notes = cost()
        tp = _tp_size(args)
        multiple = tp if getattr(args, "sequence_parallel", False) else 1
        granularity = int(getattr(args, "terapipe_granularity", DEFAULT_GRANULARITY))
        plan = solve(model, seq_length, micro_batch_size, K, granularity=granularity,
                     num_microbatches=M, order=order, multiple_of=multiple,
                     defer_wgrad={"on": True, "off": False}.get(defer))
        source = f"DP slicer (granularity {granularity}), simulator-checked"
    tp = _tp_size(args)
    plan.validate(seq_length, micro_batch_size,
                  multiple_of=tp if getattr(args, "sequence_parallel", False) else 1)
    if defer == "on":
        plan = replace(plan, defer_wgrad=True)
    report = PlanReport(seq_length, micro_batch_size, M, K, source, "none", notes=notes)
    try:
        if model is None:
            model, more = cost()
            report.notes.extend(more)
        report.cost_model = model.describe()
        from ..planner import simulate

        def timed(p: TeraPipePlan):
            return simulate(simulated_schedule(args, p, seq_length, micro_batch_size), model)

        if defer == "auto" and not planned:  # solve() has chosen for its own plans
            from ..planner.slicer import choose_deferral

            plan, mine = choose_deferral(plan, timed, lambda r: r.iteration_time)
        else:
            mine = timed(plan)
        base = timed(TeraPipePlan(seq_slices=[seq_length], order="1f1b"))
        report.iteration_time, report.bubble = mine.iteration_time, mine.bubble_fraction
        report.baseline_time, report.baseline_bubble = base.iteration_time, base.bubble_fraction
    except Exception as exc:  # noqa: BLE001 - a prediction is informative only; the plan stands
        report.notes.append(f"no prediction ({type(exc).__name__}: {exc})")
    plan = replace(plan, predicted_time=report.iteration_time)
    return plan, report


def plan_from_args(args: argparse.Namespace, seq_length: int, micro_batch_size: int) -> TeraPipePlan:
    """Explicit slices, uniform slices, or the DP slicer on the flags' cost model (one process,
    no collectives, no logging; ArgsPlanProvider adds those)."""
    provider = ArgsPlanProvider(args, log=False)
    if provider._wants_profile():
        raise TeraPipeArgumentError(
            "plan_from_args does not measure profiles: use ArgsPlanProvider(args).plan_for(...) "
            "with --terapipe-cost-model profile")
    plan, _ = plan_and_report(args, seq_length, micro_batch_size,
                              cost=lambda: provider.cost_model(seq_length, micro_batch_size))
    return plan


# ---------------------------------------------------------------------------------------------
# Setup from flags
# ---------------------------------------------------------------------------------------------
def _log_rank0(args, message: str) -> None:
    dist = _distributed()
    rank = dist.get_rank() if dist is not None else int(getattr(args, "rank", 0) or
                                                       os.environ.get("RANK", 0))
    if rank == 0:
        print(message, flush=True)


def setup_from_args(args, *, measure: Optional[Callable] = None) -> Optional[ArgsPlanProvider]:
    """Validate the flags, then route `get_forward_backward_func` accordingly and install hooks.

    --pipeline-schedule terapipe: select an ArgsPlanProvider (plans at the first iteration of
    each shape), build GPT models with slice-aware attention, run Megatron-LM's forward_step
    per cell with the cell's shape in the global args, and install(). Otherwise Megatron's own
    schedule stays in charge (install() is still harmless). Returns the provider, or None.
    """
    from . import install as integration

    validate_terapipe_args(args)
    if not terapipe_selected(args):
        integration.deselect()
        integration.set_schedule_wrapper(None)
        integration.use_slice_attention_in_gpt_models(False)
        integration.install()
        return None
    provider = ArgsPlanProvider(args, measure=measure)
    integration.select(provider)
    integration.use_slice_attention_in_gpt_models(True)
    integration.set_schedule_wrapper(integration.MegatronLMCells(trace=getattr(args, "terapipe_trace", None)))
    integration.install()
    if getattr(args, "terapipe_slices", None):
        how = f"--terapipe-slices {' '.join(map(str, args.terapipe_slices))}"
    elif getattr(args, "terapipe_num_slices", None) is not None:
        how = f"--terapipe-num-slices {args.terapipe_num_slices}"
    else:
        how = f"DP slicer on the {args.terapipe_cost_model} cost model at the first iteration"
    _log_rank0(args, f"> terapipe: pipeline schedule terapipe (order {args.terapipe_order}; "
                     f"slices: {how})")
    return provider


__all__ = [
    "ArgsPlanProvider",
    "PlanReport",
    "TeraPipeArgumentError",
    "add_terapipe_args",
    "combine_extra_args",
    "plan_and_report",
    "plan_from_args",
    "profile_cache_path",
    "setup_from_args",
    "validate_terapipe_args",
]
