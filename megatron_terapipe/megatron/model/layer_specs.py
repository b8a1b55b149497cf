"""Layer specs: Megatron's own GPT layer with slice-aware core attention in its slot."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...runtime.attention.slice_attention import SliceAttention
from ..platform import compat
from ..platform.torch_norm import TorchNorm


def transformer_engine_available() -> bool:
    """Whether transformer_engine imports. Only its absence is False: an installed one that
    fails to import (a CUDA library it cannot load, ...) raises, saying why."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def with_slice_attention(spec):
    """Copy of a GPT layer ModuleSpec whose self-attention uses SliceAttention."""
    spec = copy.deepcopy(spec)
    try:
        attention = compat.layer_submodules(compat.layer_submodules(spec).self_attention)
    except (AttributeError, ValueError) as exc:
        raise ValueError(
            "TeraPipe needs a GPT layer spec with a self_attention submodule "
            "(e.g. Megatron's get_gpt_layer_local_spec())") from exc
    if getattr(attention, "core_attention", None) is None:
        raise ValueError("TeraPipe: this layer spec has no core_attention slot to replace")
    attention.core_attention = SliceAttention
    return spec


def get_gpt_layer_spec(backend: str = "local", **kwargs: Any):
    """ModuleSpec for GPTModel layers: Megatron's layers plus slice-aware attention.

    backend: "local" (Megatron-Core modules, runs anywhere), "te" (Transformer Engine linear
    and norm layers; needs transformer-engine) or "auto" (TE when importable, else local).
    kwargs go to Megatron's spec function (e.g. normalization="RMSNorm", qk_layernorm=True).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if backend == "auto":
        # CUDA first: a CPU process does not use Transformer Engine and need not import it
        backend = "te" if torch.cuda.is_available() and transformer_engine_available() else "local"
    if kwargs.get("multi_latent_attention"):
        raise ValueError("TeraPipe does not support multi-latent attention yet")
    if backend == "local":
        base = _local_norms_to_torch(gpt_layer_specs.get_gpt_layer_local_spec(**kwargs))
    elif backend == "te":
        if not transformer_engine_available():
            raise ValueError(
                "get_gpt_layer_spec(backend='te') needs transformer-engine: install "
                "megatron-terapipe[gpu], or use backend='local'")
        base = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    else:
        raise ValueError(f"unknown backend {backend!r}: use 'local', 'te' or 'auto'")
    return with_slice_attention(base)


def _local_norms_to_torch(spec):
    """Swap the local spec's norms for TorchNorm (which also runs sequence-parallel)."""
    WrappedTorchNorm = compat.local_spec_torch_norm()
    layer = compat.layer_submodules(spec)
    for slot in ("input_layernorm", "pre_mlp_layernorm", "pre_cross_attn_layernorm"):
        if getattr(layer, slot, None) is WrappedTorchNorm:
            setattr(layer, slot, TorchNorm)
    return spec


def get_gpt_decoder_block_spec(config, backend: str = "local", vp_stage=None, **kwargs: Any):
    """Block spec for this rank's layers: slice-aware layers plus the final norm.

    Needed for the local spec with sequence parallelism (the block's final norm must support it);
    otherwise `get_gpt_layer_spec()` is enough.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = get_gpt_layer_spec(backend=backend, **kwargs)
    final_norm = TorchNorm
    if backend != "local":
        from megatron.core.transformer.transformer_block import LayerNormImpl

        final_norm = LayerNormImpl
    layers = [layer] * get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm))
