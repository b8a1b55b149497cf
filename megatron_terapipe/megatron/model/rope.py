"""Token slices of a rotary-embedding model: a slice's positions start at its first token."""

from __future__ import annotations

import torch

from ...runtime.attention.slice_attention import rope_offset_pre_hook
from ..platform import compat


def install_rope_offsets(model: torch.nn.Module) -> int:
    """Hook every rotary embedding in `model` once. Returns how many are hooked."""
    RotaryEmbedding, MultimodalRotaryEmbedding = compat.rotary_embedding_classes()
    count = 0
    for module in model.modules():
        if MultimodalRotaryEmbedding is not None and isinstance(module, MultimodalRotaryEmbedding):
            raise ValueError(
                "TeraPipe does not support multimodal RoPE (mrope) yet: use "
                "position_embedding_type 'rope' or 'learned_absolute'")
        if isinstance(module, RotaryEmbedding):
            if not getattr(module, "_terapipe_offset_hooked", False):
                module.register_forward_pre_hook(rope_offset_pre_hook, with_kwargs=True)
                module._terapipe_offset_hooked = True
            count += 1
    return count
