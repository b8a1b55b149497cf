"""Layer specs: Megatron's own GPT layer with slice-aware core attention in its slot."""

from __future__ import annotations

import copy
from typing import Any

import torch

from .attention import SliceAttention


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def with_slice_attention(spec):
    """Copy of a GPT layer ModuleSpec whose self-attention uses SliceAttention."""
    spec = copy.deepcopy(spec)
    try:
        attention = spec.submodules.self_attention.submodules
    except AttributeError as exc:
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
        backend = "te" if transformer_engine_available() and torch.cuda.is_available() else "local"
    if kwargs.get("num_experts"):
        raise ValueError("TeraPipe does not support MoE layers yet: leave num_experts unset")
    if kwargs.get("multi_latent_attention"):
        raise ValueError("TeraPipe does not support multi-latent attention yet")
    if backend == "local":
        base = gpt_layer_specs.get_gpt_layer_local_spec(**kwargs)
    elif backend == "te":
        if not transformer_engine_available():
            raise ValueError(
                "get_gpt_layer_spec(backend='te') needs transformer-engine: install "
                "megatron-terapipe[gpu], or use backend='local'")
        base = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    else:
        raise ValueError(f"unknown backend {backend!r}: use 'local', 'te' or 'auto'")
    return with_slice_attention(base)


def uses_slice_attention(model: torch.nn.Module) -> bool:
    return any(isinstance(m, SliceAttention) for m in model.modules())
