"""Megatron-LM's flags, parsed once into frozen values (as Megatron-LM builds its
TransformerConfig once): `RunSettings.from_args(args)` reads the TeraPipe flags
(`TeraPipeSettings`, each with its one default), the run's shape and parallelism (`RunShape`),
the model (`ModelDims`) and how the model state is kept. Everything downstream takes these
values; `from_args` and the support rules' adapter (support/run_views.py: view_from_args) are the
only readers of the argparse namespace. Names are Megatron-LM's (seq_length,
tensor_model_parallel_size, ...); a name a script does not define counts as unset.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

from ...plan import SliceGrid, SliceNames
from ...planner.cost.dims import ModelDims
from ...planner.cost.recompute_time import FullRecompute
from ...planner.cost.stage_memory import ModelStateConfig, parse_bytes
from ...planner.schedule_choice import TERAPIPE, AutoChoice
from ..support.run_views import view_from_args
from ..support.refusals import RunView


class TeraPipeArgumentError(ValueError):
    """A TeraPipe flag (or a Megatron-LM flag next to it) the schedule cannot run with."""


@contextlib.contextmanager
def as_flag_error() -> Iterator[None]:
    """ValueErrors raised under the flags' names (FLAG_SLICE_NAMES, ...) as TeraPipeArgumentError."""
    try:
        yield
    except TeraPipeArgumentError:
        raise
    except ValueError as exc:
        raise TeraPipeArgumentError(str(exc)) from None


#: How slice-length errors name Megatron-LM's flags (plan.SliceGrid).
FLAG_SLICE_NAMES = SliceNames(seq_length="--seq-length", granularity="--terapipe-granularity",
                              tensor_parallel="--tensor-model-parallel-size",
                              num_slices="--terapipe-num-slices",
                              summed_slices="--terapipe-slices {slices}", tp_slices="--terapipe-slices",
                              tp_multiple="--tensor-model-parallel-size {tp}")
DEFER_WGRAD = {"on": True, "off": False, "auto": None}
WGRAD_PLACEMENT = {"auto": True, "off": False}


def _flag(args, name: str, default):
    """args.<name>, or `default` when the script does not define it or leaves it empty."""
    value = getattr(args, name, None)
    return default if value in (None, "") else value


def _choice(args, name: str, choices: dict, default):
    """What a choice flag's value means (`default` when unset); an unknown value names its flag
    (a script may set it past the parser's choices)."""
    given = getattr(args, name, None)
    if given in (None, ""):
        return default
    if given not in choices:
        raise TeraPipeArgumentError(f"--{name.replace('_', '-')} must be one of "
                                    f"{', '.join(choices)}, got {given!r}")
    return choices[given]


def _int_or_none(value) -> Optional[int]:
    return None if value is None else int(value)


def _ints_or_none(values) -> Optional[tuple[int, ...]]:
    return None if values is None else tuple(int(v) for v in values)


def _size(args, name: str, default: Optional[float] = None) -> Optional[float]:
    """The bytes a size flag gives (`default` when unset); a malformed size names its flag."""
    text = getattr(args, name, None)
    if text in (None, ""):
        return default
    try:
        return parse_bytes(str(text))
    except ValueError as exc:
        raise TeraPipeArgumentError(f"--{name.replace('_', '-')}: {exc}") from None


@dataclass(frozen=True)
class TeraPipeSettings:
    """--pipeline-schedule and the --terapipe-* flags; the defaults here are the flags' own."""

    schedule: str = "1f1b"  # --pipeline-schedule: 1f1b, terapipe or auto
    order: str = "1f1b"
    virtual_placement: str = "ring"  # --terapipe-virtual-placement: ring or v (2 chunks)
    placement_given: bool = False  # whether the flag was given (unset: auto may choose a V)
    slices: Optional[tuple[int, ...]] = None  # --terapipe-slices
    num_slices: Optional[int] = None
    edge_slices: Optional[tuple[int, int, int, int]] = None  # --terapipe-edge-slices
    defer_wgrad: Optional[bool] = True  # --terapipe-defer-wgrad on / off; None: auto
    wgrad_placement: bool = True  # --terapipe-wgrad-placement auto (True) / off
    cost_model: str = "analytic"  # analytic, profile or a layer-profile file
    hardware: str = "auto"
    granularity: int = 8
    cache_dir: Optional[str] = None
    profile_points: int = 4
    cuda_graphs: bool = False
    scatter_gather: bool = False  # --terapipe-scatter-gather-p2p
    cpu: bool = False
    slice_aware_model: bool = False  # --terapipe-slice-aware-model (Megatron's schedule)
    trace: Optional[str] = None
    memory_budget: Optional[float] = None  # bytes
    model_state_memory: Optional[float] = None  # bytes
    memory_profile: Optional[str] = None
    # --terapipe-auto-trials: counted iterations per candidate auto times (0: predicted pick)
    auto_trials: int = 2

    @classmethod
    def from_args(cls, args) -> "TeraPipeSettings":
        d = cls()
        slices = getattr(args, "terapipe_slices", None)
        return cls(
            schedule=_flag(args, "pipeline_schedule", d.schedule),
            order=_flag(args, "terapipe_order", d.order),
            virtual_placement=_flag(args, "terapipe_virtual_placement", d.virtual_placement),
            placement_given=getattr(args, "terapipe_virtual_placement", None) is not None,
            slices=tuple(int(s) for s in slices) if slices else None,
            num_slices=_int_or_none(getattr(args, "terapipe_num_slices", None)),
            edge_slices=_ints_or_none(getattr(args, "terapipe_edge_slices", None)),
            defer_wgrad=_choice(args, "terapipe_defer_wgrad", DEFER_WGRAD, d.defer_wgrad),
            wgrad_placement=_choice(args, "terapipe_wgrad_placement", WGRAD_PLACEMENT,
                                    d.wgrad_placement),
            cost_model=_flag(args, "terapipe_cost_model", d.cost_model),
            hardware=_flag(args, "terapipe_hardware", d.hardware),
            granularity=int(_flag(args, "terapipe_granularity", d.granularity)),
            cache_dir=_flag(args, "terapipe_cache_dir", d.cache_dir),
            profile_points=int(_flag(args, "terapipe_profile_points", d.profile_points)),
            cuda_graphs=bool(getattr(args, "terapipe_cuda_graphs", d.cuda_graphs)),
            scatter_gather=bool(getattr(args, "terapipe_scatter_gather_p2p", d.scatter_gather)),
            cpu=bool(getattr(args, "terapipe_cpu", d.cpu)),
            slice_aware_model=bool(getattr(args, "terapipe_slice_aware_model",
                                           d.slice_aware_model)),
            trace=_flag(args, "terapipe_trace", d.trace),
            memory_budget=_size(args, "terapipe_memory_budget", d.memory_budget),
            model_state_memory=_size(args, "terapipe_model_state_memory", d.model_state_memory),
            memory_profile=_flag(args, "terapipe_memory_profile", d.memory_profile),
            auto_trials=int(_flag(args, "terapipe_auto_trials", d.auto_trials)))

    @property
    def selected(self) -> bool:
        """--pipeline-schedule terapipe."""
        return self.schedule == "terapipe"

    @property
    def auto(self) -> bool:
        """--pipeline-schedule auto, not yet resolved (auto_schedule.resolve_auto_schedule)."""
        return self.schedule == "auto"

    @property
    def slices_given(self) -> bool:
        """Whether the flags fix the slices (--terapipe-slices, -num-slices or -edge-slices)."""
        return bool(self.slices) or self.num_slices is not None or self.edge_slices is not None

    def given_flags(self) -> list[str]:
        """The flags that only mean something with --pipeline-schedule terapipe or auto."""
        return [flag for flag, given in (
            ("--terapipe-slices", bool(self.slices)),
            ("--terapipe-num-slices", self.num_slices is not None),
            ("--terapipe-edge-slices", self.edge_slices is not None),
            ("--terapipe-memory-budget", self.memory_budget is not None),
            ("--terapipe-cuda-graphs", self.cuda_graphs),
            ("--terapipe-virtual-placement v", self.virtual_placement == "v"),
            ("--terapipe-scatter-gather-p2p", self.scatter_gather)) if given]


@dataclass(frozen=True)
class RunShape:
    """One iteration's batch and the run's parallelism, as the flags give them.

    num_microbatches follows the micro batch size (global / (micro x data parallel)) unless
    the script fixes it (--num-microbatches); `for_batch` gives the shape of another batch."""

    seq_length: Optional[int] = None  # None: the script gives no --seq-length
    micro_batch_size: int = 1
    num_microbatches: int = 1
    pipeline_parallel: int = 1
    tensor_parallel: int = 1
    data_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    sequence_parallel: bool = False
    dtype: str = "fp32"  # fp32, bf16 or fp16
    world_size: int = 1
    ranks_per_node: int = 1  # LOCAL_WORLD_SIZE, else the world
    global_batch_size: Optional[int] = None  # set when num_microbatches follows it
    rampup: bool = False  # --rampup-batch-size: the microbatch count changes while training
    recompute: str = ""  # Megatron's recomputation flags as given ("" when none)
    full_recompute: Optional[FullRecompute] = None  # what the planner prices of them
    # --microbatch-group-size-per-virtual-pipeline-stage as given (None: unset, the planner's)
    microbatch_group: Optional[int] = None

    @classmethod
    def from_args(cls, args) -> "RunShape":
        tp, pp, cp = (int(getattr(args, name, 1) or 1) for name in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
        world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", 1))
        dp = int(getattr(args, "data_parallel_size", None) or max(1, world // (tp * pp * cp)))
        fixed = getattr(args, "num_microbatches", None)
        gbs = None if fixed else _int_or_none(getattr(args, "global_batch_size", None) or None)
        dtype = ("bf16" if getattr(args, "bf16", False) else
                 "fp16" if getattr(args, "fp16", False) else "fp32")
        shape = cls(_int_or_none(getattr(args, "seq_length", None)),
                    int(getattr(args, "micro_batch_size", None) or 1), int(fixed or 1), pp, tp, dp,
                    cp, int(getattr(args, "expert_model_parallel_size", 1) or 1),
                    bool(getattr(args, "sequence_parallel", False)), dtype, world,
                    int(os.environ.get("LOCAL_WORLD_SIZE", world)), gbs,
                    bool(getattr(args, "rampup_batch_size", None)), recompute_flags(args),
                    full_recompute_of(args),
                    _int_or_none(getattr(args, "microbatch_group_size_per_vp_stage", None)))
        return shape.for_batch(shape.seq_length, shape.micro_batch_size)

    def for_batch(self, seq_length: Optional[int], micro_batch_size: int) -> "RunShape":
        """This run with another (sequence length, micro batch size)."""
        n = self.num_microbatches
        if self.global_batch_size:
            n = max(1, self.global_batch_size // (micro_batch_size * self.data_parallel))
        return replace(self, seq_length=seq_length, micro_batch_size=int(micro_batch_size),
                       num_microbatches=n)

    @property
    def tp_multiple(self) -> int:
        """What sequence parallelism asks of every slice length: a multiple of the TP size."""
        return self.tensor_parallel if self.sequence_parallel else 1

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2


def recompute_flags(args) -> str:
    """Megatron's activation recomputation as flags ("" without): the start-up report names
    them (full recomputation priced, selective not), as do budget errors under selective."""
    granularity = getattr(args, "recompute_granularity", None)
    if not granularity:
        return ""
    text = f"--recompute-granularity {granularity}"
    method, layers = getattr(args, "recompute_method", None), getattr(args, "recompute_num_layers", None)
    if granularity == "full":
        text += f" --recompute-method {method}" if method else ""
        text += f" --recompute-num-layers {layers}" if layers else ""
    modules = getattr(args, "recompute_modules", None)
    if granularity == "selective" and modules:
        text += " --recompute-modules " + " ".join(map(str, modules))
    return text


def full_recompute_of(args) -> Optional[FullRecompute]:
    """Megatron's full recomputation as the planner prices it (None: none, or selective)."""
    if getattr(args, "recompute_granularity", None) != "full":
        return None
    method, layers = getattr(args, "recompute_method", None), getattr(args, "recompute_num_layers", None)
    with as_flag_error():
        return FullRecompute(str(method), int(layers if layers is not None else 1))


#: Megatron-LM's flags without which the planner has no model to price.
MODEL_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads")


def model_from_args(args) -> tuple[Optional[ModelDims], str]:
    """The planner's ModelDims from Megatron-LM's model flags: (dims, '') or (None, why not);
    why not is '' when the script gives no model shape."""
    if any(getattr(args, name, None) is None for name in MODEL_SHAPE_FLAGS):
        return None, ""
    gqa = getattr(args, "group_query_attention", False)
    groups = getattr(args, "num_query_groups", None) if gqa else None
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
                         name="this model"), ""
    except (TypeError, ValueError) as exc:
        return None, str(exc) or type(exc).__name__


@dataclass(frozen=True)
class RunSettings:
    """Everything the flags say about a run, parsed once."""

    terapipe: TeraPipeSettings = TeraPipeSettings()
    shape: RunShape = RunShape()
    model: Optional[ModelDims] = None  # None: no model shape in the flags (or `model_problem`)
    model_problem: str = ""  # why the model shape the flags give is not one
    model_state: ModelStateConfig = field(default_factory=ModelStateConfig)
    position_embedding_type: str = "learned_absolute"
    attention_backend: str = "auto"  # --attention-backend by name
    support: RunView = RunView()  # what the support rules test (support/refusals.py)

    @classmethod
    def from_args(cls, args) -> "RunSettings":
        """Parse Megatron-LM's args once. Raises TeraPipeArgumentError for a malformed size."""
        terapipe = TeraPipeSettings.from_args(args)
        shape = RunShape.from_args(args)
        model, problem = model_from_args(args)
        state = ModelStateConfig(
            dtype_bytes=shape.dtype_bytes, data_parallel=shape.data_parallel,
            distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
            tensor_parallel=shape.tensor_parallel,
            untie_embeddings=bool(getattr(args, "untie_embeddings_and_output_weights", False)))
        with as_flag_error():  # a layer split Megatron cannot build, named by its flags
            support = view_from_args(args)
        return cls(terapipe, shape, model, problem, state,
                   support.position_embedding_type or "learned_absolute",
                   support.attention_backend, support)

    @property
    def microbatch_group(self) -> Optional[int]:
        """The plan's microbatch group when the flags fix it: Megatron's
        --microbatch-group-size-per-virtual-pipeline-stage, on virtual stages in the 1f1b order
        (gpipe runs every forward first: no groups); else None (the planner's, or the fewest
        that fill the ring)."""
        if self.support.virtual_stages > 1 and self.terapipe.order == "1f1b":
            return self.shape.microbatch_group
        return None

    @property
    def model_given(self) -> bool:
        """Whether the flags name a model shape (valid or not)."""
        return self.model is not None or bool(self.model_problem)

    def require_model(self) -> ModelDims:
        """The model, or TeraPipeArgumentError naming the flags that give it."""
        if self.model is None:
            raise TeraPipeArgumentError(
                "planning needs the model shape (--num-layers, --hidden-size, "
                f"--num-attention-heads): {self.model_problem or 'the flags give none'}; or "
                "give --terapipe-slices / --terapipe-num-slices")
        return self.model

    @property
    def grid(self) -> SliceGrid:
        """The slice lengths this run allows (raises for a non-positive granularity)."""
        with as_flag_error():
            return SliceGrid(self.terapipe.granularity, self.shape.tp_multiple,
                             names=FLAG_SLICE_NAMES)

    def for_batch(self, seq_length: int, micro_batch_size: int) -> "RunSettings":
        """These settings for one (sequence length, micro batch size) the schedule runs."""
        return replace(self, shape=self.shape.for_batch(seq_length, micro_batch_size))


def apply_choice(args, choice: AutoChoice) -> None:
    """Write --pipeline-schedule auto's choice into Megatron-LM's args, which run it: TeraPipe
    with its order, or Megatron's schedule, with virtual pipeline stages (as Megatron-LM's
    --num-virtual-stages-per-pipeline-rank sets them) for the interleaved one and for TeraPipe
    on model chunks. The settings of the chosen run are `RunSettings.from_args(args)` after
    it."""
    chosen = choice.chosen
    if chosen.family == TERAPIPE:  # on model chunks too: TeraPipe's cells on virtual stages
        args.pipeline_schedule, args.terapipe_order = "terapipe", chosen.order
        if chosen.placement == "v":
            args.terapipe_virtual_placement = "v"
    else:
        args.pipeline_schedule = "1f1b"
    if chosen.num_chunks > 1:
        args.num_virtual_stages_per_pipeline_rank = chosen.num_chunks
        args.virtual_pipeline_model_parallel_size = chosen.num_chunks
        # Megatron's interleaved 1F1B in its default groups (auto refuses a group flag);
        # TeraPipe's plan keeps the group its search chose, so the flag stays unset for it.
        if chosen.family != TERAPIPE and getattr(args, "microbatch_group_size_per_vp_stage", None) is None:
            args.microbatch_group_size_per_vp_stage = RunShape.from_args(args).pipeline_parallel


def apply_layout(args, chunks: int, order: str, placement: str = "ring") -> None:
    """Write --pipeline-schedule auto's layout into Megatron-LM's args when auto measures
    within it (auto_trials.py): TeraPipe's schedule, which runs the trials, in `order`, on
    `chunks` model chunks per stage, round the ring or in a V (Megatron's interleaved schedule,
    a trial candidate on the ring, keeps its default microbatch groups)."""
    args.pipeline_schedule, args.terapipe_order = "terapipe", order
    if placement == "v":
        args.terapipe_virtual_placement = "v"
    if chunks > 1:
        args.num_virtual_stages_per_pipeline_rank = chunks
        args.virtual_pipeline_model_parallel_size = chunks
