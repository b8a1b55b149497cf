"""Glue to Megatron: route get_forward_backward_func to TeraPipe while a plan is selected, and
give GPT models built by an unmodified script slice-aware attention. What is selected lives in
selection.py; Megatron-LM's per-cell wrapper in lm_cells.py."""

from __future__ import annotations

import functools
from typing import Callable, Optional

from ..model import v_layout
from ..platform import compat
from ..support.refusals import RunView, check_view
from .selection import STATE

_ORIGINAL_GET_FORWARD_BACKWARD: Optional[Callable] = None
_SLICE_ATTENTION_IN_GPT_MODELS = False


def _terapipe_or_megatron(*args, **kwargs):
    from .forward_backward import forward_backward_terapipe

    if STATE.selected:
        # virtual stages (vp_size) run when the plan has as many chunks: checked at the call
        schedule_groups = kwargs.get("schedule_pg_collection", args[2] if len(args) > 2 else None)
        check_view(RunView(multi_module=compat.is_multi_module_collection(schedule_groups)))
        terapipe = forward_backward_terapipe
        if STATE.schedule_wrapper is not None:
            terapipe = STATE.schedule_wrapper(forward_backward_terapipe)
        if STATE.measured is not None:  # auto's trials: Megatron's schedule is a candidate
            assert _ORIGINAL_GET_FORWARD_BACKWARD is not None
            megatron = _ORIGINAL_GET_FORWARD_BACKWARD(*args, **kwargs)
            return STATE.measured.wrap(megatron, terapipe)  # type: ignore[attr-defined]
        return terapipe
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


# ---------------------------------------------------------------------------------------------
# GPT models built by an unmodified script get slice-aware attention
# ---------------------------------------------------------------------------------------------
def slice_attention_spec(spec):
    """`spec` (a GPT layer ModuleSpec, or a block spec with layer_specs) with SliceAttention."""
    from ..model.layer_specs import with_slice_attention

    layer_specs = getattr(spec, "layer_specs", None)
    if layer_specs is not None:  # TransformerBlockSubmodules: one spec per layer
        import copy

        spec = copy.copy(spec)
        spec.layer_specs = [with_slice_attention(s) for s in layer_specs]
        return spec
    return with_slice_attention(spec)


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    """`line` on the first rank, once per process."""
    import torch.distributed as dist

    if line in _SAID or (dist.is_available() and dist.is_initialized() and dist.get_rank()):
        return
    _SAID.add(line)
    print(line, flush=True)


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
            _say_once("> terapipe: GPT model layers built with slice-aware core attention")
        # in a V (--terapipe-virtual-placement v): the V's roles and layer numbers
        v_layout.build_in_v(original, self, config, transformer_layer_spec, *args, **kwargs)

    __init__._terapipe_wrapped = True  # type: ignore[attr-defined]
    GPTModel.__init__ = __init__  # type: ignore[method-assign]
