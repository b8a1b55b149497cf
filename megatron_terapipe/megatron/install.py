"""Glue to Megatron: attach a plan to a config, and route get_forward_backward_func to TeraPipe."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

from ..plan import TeraPipePlan
from . import compat

_ORIGINAL_GET_FORWARD_BACKWARD: Optional[Callable] = None
_SELECTED = False
_DEFAULT_SOURCE = None  # plan or provider used when a model config carries none
_SCHEDULE_WRAPPER: Optional[Callable[[Callable], Callable]] = None  # e.g. MegatronLMCells
_SLICE_ATTENTION_IN_GPT_MODELS = False


def select(source) -> None:
    """Use `source` (a TeraPipePlan or a provider with plan_for) for every model, e.g. from flags."""
    global _DEFAULT_SOURCE, _SELECTED
    if not isinstance(source, TeraPipePlan) and not hasattr(source, "plan_for"):
        raise ValueError(f"select() takes a TeraPipePlan or a plan provider, got {type(source).__name__}")
    _DEFAULT_SOURCE = source
    _SELECTED = True


def default_plan_source():
    return _DEFAULT_SOURCE


def configure(config, plan) -> None:
    """Validate `plan` against the model config and attach it (config.terapipe_plan).

    `plan` is a TeraPipePlan, or a provider with `plan_for(seq_length, micro_batch_size)` for
    runs whose sequence length changes. Also selects TeraPipe for `get_forward_backward_func`
    once `install()` has run.
    """
    global _SELECTED
    if isinstance(plan, TeraPipePlan):
        check_config(config, plan)
    elif not hasattr(plan, "plan_for"):
        raise ValueError(
            f"configure() takes a TeraPipePlan or a plan provider with plan_for(), got {type(plan).__name__}")
    else:
        check_config(config, None)
    config.terapipe_plan = plan
    _SELECTED = True


def check_config(config, plan: Optional[TeraPipePlan], cp_size: Optional[int] = None) -> None:
    """Model-level features TeraPipe cannot run, named with the fix.

    cp_size: the context-parallel group's size when known (the schedule passes it), else the
    config's context_parallel_size.
    """
    cp = cp_size if cp_size is not None else getattr(config, "context_parallel_size", 1)
    if cp > 1:
        raise ValueError(
            f"TeraPipe does not support context parallelism (context_parallel_size={cp}): "
            "token slices already split the sequence; set --context-parallel-size 1")
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        raise ValueError(
            "TeraPipe does not support virtual pipeline stages: drop "
            "--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size")
    if getattr(config, "num_moe_experts", None):
        raise ValueError("TeraPipe does not support MoE models yet: unset --num-experts "
                         "or use Megatron's 1f1b schedule")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("TeraPipe does not support --defer-embedding-wgrad-compute: drop it")
    if getattr(config, "mtp_num_layers", None):
        raise ValueError("TeraPipe does not support multi-token prediction: unset --mtp-num-layers")
    if plan is not None and getattr(config, "sequence_parallel", False):
        plan.check_multiple_of(config.tensor_model_parallel_size)


def deselect() -> None:
    """Make get_forward_backward_func return Megatron's own schedules again."""
    global _SELECTED, _DEFAULT_SOURCE, _SCHEDULE_WRAPPER
    _SELECTED = False
    _DEFAULT_SOURCE = None
    _SCHEDULE_WRAPPER = None


def selected() -> bool:
    return _SELECTED


def _terapipe_or_megatron(*args, **kwargs):
    from .forward_backward import forward_backward_terapipe

    if _SELECTED:
        vp_size = kwargs.get("vp_size", args[1] if len(args) > 1 else None)
        if vp_size is not None and vp_size > 1:
            raise ValueError("TeraPipe does not support virtual pipeline stages: drop "
                             "--num-layers-per-virtual-pipeline-stage")
        schedule_groups = kwargs.get("schedule_pg_collection", args[2] if len(args) > 2 else None)
        if compat.is_multi_module_collection(schedule_groups):
            raise ValueError(
                "TeraPipe does not support multi-module pipelines (a "
                "MultiModuleProcessGroupCollection selects Megatron's bridge schedule): use "
                "Megatron's own schedule (drop --pipeline-schedule terapipe)")
        if _SCHEDULE_WRAPPER is not None:
            return _SCHEDULE_WRAPPER(forward_backward_terapipe)
        return forward_backward_terapipe
    assert _ORIGINAL_GET_FORWARD_BACKWARD is not None
    return _ORIGINAL_GET_FORWARD_BACKWARD(*args, **kwargs)


def install() -> None:
    """Point Megatron's get_forward_backward_func (and names that imported it) at TeraPipe.

    The patched getter returns the TeraPipe schedule while a plan is configured, and Megatron's
    own schedule otherwise. Calling install() again is harmless. The modules it patches are
    listed (and version-checked) in compat.SCHEDULE_GETTER_MODULES.
    """
    global _ORIGINAL_GET_FORWARD_BACKWARD
    modules = compat.schedule_getter_modules()
    if _ORIGINAL_GET_FORWARD_BACKWARD is None:
        from megatron.core.pipeline_parallel import schedules

        _ORIGINAL_GET_FORWARD_BACKWARD = schedules.get_forward_backward_func
    _terapipe_or_megatron.__wrapped__ = _ORIGINAL_GET_FORWARD_BACKWARD  # type: ignore[attr-defined]
    # Includes modules that did `from ... import get_forward_backward_func` before install().
    for module in modules:
        module.get_forward_backward_func = _terapipe_or_megatron


def original_get_forward_backward_func() -> Callable:
    from megatron.core.pipeline_parallel import schedules

    return _ORIGINAL_GET_FORWARD_BACKWARD or schedules.get_forward_backward_func


def set_schedule_wrapper(wrapper: Optional[Callable[[Callable], Callable]]) -> None:
    """While TeraPipe is selected, get_forward_backward_func returns `wrapper(schedule)`.

    `setup_from_args` uses it to run Megatron-LM's forward_step per cell (MegatronLMCells).
    None restores the plain schedule.
    """
    global _SCHEDULE_WRAPPER
    _SCHEDULE_WRAPPER = wrapper


# ---------------------------------------------------------------------------------------------
# GPT models built by an unmodified script get slice-aware attention
# ---------------------------------------------------------------------------------------------
def slice_attention_spec(spec):
    """`spec` (a GPT layer ModuleSpec, or a block spec with layer_specs) with SliceAttention."""
    from .spec import with_slice_attention

    layer_specs = getattr(spec, "layer_specs", None)
    if layer_specs is not None:  # TransformerBlockSubmodules: one spec per layer
        import copy

        spec = copy.copy(spec)
        spec.layer_specs = [with_slice_attention(s) for s in layer_specs]
        return spec
    return with_slice_attention(spec)


def use_slice_attention_in_gpt_models(enable: bool = True) -> None:
    """Make every GPTModel built from now on use slice-aware core attention in its layer spec.

    This is how an unmodified Megatron-LM script (its gpt_builder picks Megatron's local or
    Transformer Engine spec) gets the attention TeraPipe needs. The constructor is wrapped once;
    `enable=False` turns the substitution off again.
    """
    global _SLICE_ATTENTION_IN_GPT_MODELS
    _SLICE_ATTENTION_IN_GPT_MODELS = enable
    if not enable:
        return
    GPTModel = compat.gpt_model_class()
    if getattr(GPTModel.__init__, "_terapipe_wrapped", False):
        return
    original = GPTModel.__init__

    @functools.wraps(original)
    def __init__(self, config, transformer_layer_spec=None, *args, **kwargs):
        if _SLICE_ATTENTION_IN_GPT_MODELS and transformer_layer_spec is not None:
            transformer_layer_spec = slice_attention_spec(transformer_layer_spec)
        original(self, config, transformer_layer_spec, *args, **kwargs)

    __init__._terapipe_wrapped = True  # type: ignore[attr-defined]
    GPTModel.__init__ = __init__  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------
# Megatron-LM's forward_step / get_batch / loss_func, unchanged, on token slices
# ---------------------------------------------------------------------------------------------
def megatron_lm_args() -> Optional[Any]:
    """Megatron-LM's global args (megatron.training.get_args()), or None outside Megatron-LM."""
    return compat.megatron_lm_global_args()


@contextlib.contextmanager
def megatron_lm_cell_args(args, cell, drop_mask: bool) -> Iterator[None]:
    """The global args as one cell sees them: seq_length and micro_batch_size are the cell's.

    Megatron-LM's get_batch_on_this_tp_rank allocates the tensors that tensor-parallel ranks
    other than 0 receive with shape (args.micro_batch_size, args.seq_length); rank 0 sends the
    cell's cut batch. With drop_mask, no attention mask is allocated either (rank 0 sends none:
    see CellBatches), because a cut causal mask [rows, 1, tokens, end] is not square.
    """
    saved = {k: getattr(args, k, None)
             for k in ("seq_length", "micro_batch_size", "create_attention_mask_in_dataloader")}
    args.seq_length = cell.tokens
    args.micro_batch_size = cell.rows
    if drop_mask:
        args.create_attention_mask_in_dataloader = False
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(args, k, v)


def is_causal_cut(mask, cell) -> bool:
    """Whether `mask` ([b or 1, 1, tokens, end], True = masked) is the plain causal mask cut to
    the cell, i.e. what slice-aware attention applies anyway without a mask."""
    import torch

    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return False
    if tuple(mask.shape[-2:]) != (cell.tokens, cell.token_end):
        return False
    future = torch.ones(cell.tokens, cell.token_end, dtype=torch.bool,
                        device=mask.device).triu(cell.token_start + 1)
    return bool((mask.bool() == future).all())


class CellBatches:
    """The cell iterator as Megatron-LM's get_batch needs it: contiguous tensors (they are
    broadcast over the tensor-parallel group), and a plain causal mask left out (slice-aware
    attention applies it itself; with TP > 1 it must go, see megatron_lm_cell_args)."""

    def __init__(self, inner: Iterator, cell, must_drop_mask: bool) -> None:
        self.inner = inner
        self.cell = cell
        self.must_drop_mask = must_drop_mask

    def __iter__(self):
        return self

    def __next__(self):
        import torch

        batch = next(self.inner)
        if isinstance(batch, dict):
            batch = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v)
                     for k, v in batch.items()}
            if "attention_mask" in batch:
                mask = batch["attention_mask"]
                if mask is None or is_causal_cut(mask, self.cell):
                    del batch["attention_mask"]
                elif self.must_drop_mask:
                    raise ValueError(
                        "TeraPipe with --tensor-model-parallel-size > 1 supports only the plain "
                        "causal attention mask, but the data has another one (e.g. from "
                        "--reset-attention-mask): drop it, or use --tensor-model-parallel-size 1")
        elif isinstance(batch, (list, tuple)):
            batch = type(batch)(v.contiguous() if isinstance(v, torch.Tensor) else v for v in batch)
        return batch


class MegatronLMCells:
    """Schedule wrapper for Megatron-LM scripts (see set_schedule_wrapper).

    Runs the script's forward_step for each cell with the cell's shape in Megatron-LM's global
    args (megatron_lm_cell_args) and its batch through CellBatches, so that stock pretrain_gpt
    forward_step, get_batch and loss_func work unchanged, also with tensor parallelism. With a
    trace path, the measured timeline of the first two training iterations is written there
    (the second overwrites the first: it has no warm-up effects).
    """

    def __init__(self, trace: Optional[str] = None) -> None:
        self.trace = trace
        self.training_runs = 0

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        from ..runtime.context import active_cell

        if getattr(forward_step_func, "_terapipe_cells", False):
            return forward_step_func

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator, model, *args, **kwargs):
            active = active_cell()
            megatron_args = megatron_lm_args()
            if active is None or megatron_args is None:
                return forward_step_func(data_iterator, model, *args, **kwargs)
            cell = active.cell
            tp = int(getattr(megatron_args, "tensor_model_parallel_size", 1) or 1)
            if data_iterator is not None:
                data_iterator = CellBatches(data_iterator, cell, must_drop_mask=tp > 1)
            with megatron_lm_cell_args(megatron_args, cell, drop_mask=tp > 1):
                return forward_step_func(data_iterator, model, *args, **kwargs)

        forward_step._terapipe_cells = True  # type: ignore[attr-defined]
        return forward_step

    def __call__(self, schedule: Callable) -> Callable:
        @functools.wraps(schedule)
        def forward_backward_terapipe(**kwargs):
            if kwargs.get("forward_step_func") is not None:
                kwargs["forward_step_func"] = self.wrap_forward_step(kwargs["forward_step_func"])
            if not (self.trace and not kwargs.get("forward_only", False) and self.training_runs < 2):
                return schedule(**kwargs)
            self.training_runs += 1
            runs: list = []
            callers_on_run = kwargs.pop("on_run", None) or (lambda record: None)
            result = schedule(**kwargs, on_run=lambda record: (runs.append(record),
                                                                callers_on_run(record)))
            from ..runtime.trace import gather_trace

            gather_trace(runs[-1], self.trace)  # every rank calls the schedule
            return result

        return forward_backward_terapipe
