"""Megatron-LM's own script on model chunks in a V (--terapipe-virtual-placement v).

Megatron-LM asks parallel_state where a chunk sits: `is_pipeline_first_stage(ignore_virtual=
False, vp_stage=c)` / `is_pipeline_last_stage(...)` decide which chunks get a dataset and
labels (pretrain_gpt.py), and the ring's answers put the loss on the last rank. While a V is
on (`use_v_layout`), those two answer as the V places chunk c (v_chunks.v_chunk_roles): the
embedding on rank 0's chunk 0, the loss on rank 0's chunk 1. While a cell of chunk c runs its
forward_step (`cell_chunk`), the questions without a chunk (`ignore_virtual=True`, which
get_batch_on_this_tp_rank asks to choose what tensor-parallel ranks receive) answer for that
chunk too. Every other question (outside a cell, without vp_stage) keeps Megatron's answer:
the physical first and last ranks, where Megatron-LM reduces and logs the losses, so
`losses_to_last_rank` hands rank 0's losses to the last rank after each schedule run.

GPT models built while a V is on (`build_in_v`) get the V's pre_process / post_process, as
many layers as the V's chunk holds (on a stage of odd layers one more down than back,
plan.v_chunk_layers: get_num_layers_to_build answers so), their layers renumbered
(v_chunks.place_in_v), and a sharded state dict that names each layer by its place in the
model, so Megatron's distributed checkpoints load across layouts (1f1b <-> V).
Under --fp16 / --bf16, Megatron's Float16Module casts a chunk's inputs and outputs where the
ring's first and last chunks sit (pipeline_parallel.utils, not parallel_state); in a V it casts
them on rank 0's chunks 0 and 1 (`_float16_in_v`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from typing import Any, Callable, Iterator, Optional

import torch

from ...plan import v_chunk_layers
from .v_chunks import _inner, place_in_v, v_chunk_roles

_V_ON = False
_CELL_CHUNK: Optional[int] = None  # the chunk whose cell's forward_step runs


def v_layout_on() -> bool:
    return _V_ON


def use_v_layout(enable: bool = True) -> None:
    """Answer Megatron's stage questions as a V places the chunks (module docstring). The
    two functions are wrapped once; `enable=False` gives Megatron's answers back."""
    global _V_ON
    _V_ON = enable
    from megatron.core import parallel_state

    for name, role in (("is_pipeline_first_stage", 0), ("is_pipeline_last_stage", 1)):
        original = getattr(parallel_state, name)
        if not getattr(original, "_terapipe_v", False):
            setattr(parallel_state, name, _asked_in_v(original, role))
    from megatron.core.transformer import module

    if enable and not getattr(module.Float16Module.forward, "_terapipe_v", False):
        module.Float16Module.forward = _float16_in_v(module, module.Float16Module.forward)
    if enable:
        _count_layers_in_v()


#: The modules that call Megatron-Core's get_num_layers_to_build by a name of their own while
#: a GPT model's chunks are built (0.16 to 0.19).
LAYER_COUNT_USERS = ("megatron.core.transformer.transformer_block",
                     "megatron.core.models.gpt.gpt_layer_specs")


def _count_layers_in_v() -> None:
    """get_num_layers_to_build, where the model's modules call it, answers a V's chunk sizes:
    plan.v_chunk_layers's (down, back) on a stage of odd layers (the ring's chunks must divide
    it and Megatron asserts they do); Megatron's own answer otherwise."""
    import importlib

    for name in LAYER_COUNT_USERS:
        users = importlib.import_module(name)
        original = getattr(users, "get_num_layers_to_build", None)
        if original is None:
            raise RuntimeError(
                f"TeraPipe: {name} has no get_num_layers_to_build, by which a V sizes its "
                "chunks: this megatron-core is not one TeraPipe supports for "
                "--terapipe-virtual-placement v (0.16 to 0.19)")
        if not getattr(original, "_terapipe_v", False):
            users.get_num_layers_to_build = _layers_in_v(original)


def _layers_in_v(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_num_layers_to_build(config, vp_stage=None, pp_rank=None, *args, **kwargs):
        layers = v_chunk_layers_of(config) if _V_ON and vp_stage is not None else ()
        if layers:
            return layers[int(vp_stage)]
        return original(config, vp_stage, pp_rank, *args, **kwargs)

    get_num_layers_to_build._terapipe_v = True  # type: ignore[attr-defined]
    return get_num_layers_to_build


def v_chunk_layers_of(config) -> tuple[int, ...]:
    """The V's (down, back) chunk layers for a model config; () where they are equal."""
    pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    layers = int(getattr(config, "num_layers", 0) or 0)
    if pp < 2 or layers % pp or layers // pp < 2:
        return ()
    return v_chunk_layers(layers // pp)


#: What `_float16_in_v` uses of megatron/core/transformer/module.py (0.16 to 0.19).
FLOAT16_NAMES = ("fp32_to_float16", "float16_to_fp32")


def _float16_in_v(casts, original: Callable) -> Callable:
    """Float16Module.forward as 0.16 to 0.19 write it (`casts`: its module), with the V's first
    and last chunk."""
    missing = [name for name in FLOAT16_NAMES if not hasattr(casts, name)]
    if missing:
        raise RuntimeError(
            f"TeraPipe: {casts.__name__} has no {', '.join(missing)}, by which a V casts for "
            "--fp16 / --bf16: this megatron-core is not one TeraPipe supports for "
            "--terapipe-virtual-placement v (0.16 to 0.19)")

    @functools.wraps(original)
    def forward(self, *inputs, fp32_output=True, **kwargs):
        chunk = getattr(self, "vp_stage", None)
        if not _V_ON or chunk is None:
            return original(self, *inputs, fp32_output=fp32_output, **kwargs)
        first, last = v_chunk_roles(int(chunk), *_pipeline_rank_and_size())
        if first:
            inputs = casts.fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if last and fp32_output is True:
            outputs = casts.float16_to_fp32(outputs)
        return outputs

    forward._terapipe_v = True  # type: ignore[attr-defined]
    return forward


def _asked_in_v(original: Callable, role: int) -> Callable:
    @functools.wraps(original)
    def stage_question(ignore_virtual=True, vp_stage=None):
        chunk = _chunk_asked(ignore_virtual, vp_stage)
        if chunk is None:
            return original(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        rank, size = _pipeline_rank_and_size()
        return v_chunk_roles(chunk, rank, size)[role]

    stage_question._terapipe_v = True  # type: ignore[attr-defined]
    return stage_question


def _chunk_asked(ignore_virtual: bool, vp_stage: Optional[int]) -> Optional[int]:
    """The chunk a stage question is about in a V; None: Megatron's own answer."""
    if not _V_ON:
        return None
    if not ignore_virtual and vp_stage is not None:
        return int(vp_stage)
    return _CELL_CHUNK


def _pipeline_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size())


@contextlib.contextmanager
def cell_chunk(model: torch.nn.Module) -> Iterator[None]:
    """While a cell of `model` (a chunk Megatron-LM built with its vp_stage) runs its
    forward_step: the stage questions without a chunk are about this one."""
    global _CELL_CHUNK
    chunk = getattr(_inner(model), "vp_stage", None) if _V_ON else None
    if chunk is None:
        yield
        return
    saved, _CELL_CHUNK = _CELL_CHUNK, int(chunk)
    try:
        yield
    finally:
        _CELL_CHUNK = saved


def build_in_v(original_init: Callable, model: torch.nn.Module, *args, **kwargs) -> None:
    """GPTModel.__init__ (`original_init`) for a chunk of a V: the V's pre_process and
    post_process for its vp_stage, then its layers renumbered and named by their place."""
    bound = inspect.signature(original_init).bind(model, *args, **kwargs) if _V_ON else None
    chunk = bound.arguments.get("vp_stage") if bound is not None else None
    if chunk is None:
        original_init(model, *args, **kwargs)
        return
    rank, size = _pipeline_rank_and_size()
    bound.arguments["pre_process"], bound.arguments["post_process"] = v_chunk_roles(
        int(chunk), rank, size)
    original_init(*bound.args, **bound.kwargs)
    place_in_v(model, int(chunk), rank, size, v_chunk_layers_of(model.config))
    _name_layers_by_place(model.decoder)


def _name_layers_by_place(block: torch.nn.Module) -> None:
    """TransformerBlock.sharded_state_dict keys each layer by its layer_number (its place in
    the model) and finds it in the block by that number less the ring's offset of the chunk
    (get_transformer_layer_offset): in a V the offset is the chunk's first layer_number - 1."""
    module = sys.modules[type(block).__module__]
    if not hasattr(module, "get_transformer_layer_offset"):
        raise RuntimeError(
            f"TeraPipe: {module.__name__} has no get_transformer_layer_offset, by which a V names "
            "its layers in checkpoints: this megatron-core is not one TeraPipe supports for "
            "--terapipe-virtual-placement v (0.16 to 0.19)")
    layers = list(getattr(block, "layers", []))
    offset = layers[0].layer_number - 1 if layers else 0
    original = block.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(*args, **kwargs):
        saved = module.get_transformer_layer_offset
        module.get_transformer_layer_offset = lambda *a, **k: offset
        try:
            return original(*args, **kwargs)
        finally:
            module.get_transformer_layer_offset = saved

    block.sharded_state_dict = sharded_state_dict


def losses_to_last_rank(losses: list, device: torch.device) -> list:
    """Rank 0's losses (a V's loss chunk is there) also on the last pipeline rank, where
    Megatron-LM's train_step and evaluate reduce them; every pipeline rank calls this."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    rank, size = _pipeline_rank_and_size()
    payload: list[Any] = [_moved(losses, torch.device("cpu")) if rank == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_process_group_ranks(group)[0], group=group)
    return _moved(payload[0], device) if rank == size - 1 else losses


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, device) for v in value)
    return value
