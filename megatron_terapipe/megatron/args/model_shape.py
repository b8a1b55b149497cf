"""The model Megatron-LM's flags describe, as the planner's ModelDims, and the device this
process runs on (both also key the measured-profile cache)."""

from __future__ import annotations

import platform

from ...planner.cost.dims import ModelDims
from .checks import TeraPipeArgumentError
from .flags import int_or_none


#: Megatron-LM's flags without which the planner has no model to price.
MODEL_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads")


def model_shape_given(args) -> bool:
    """Whether the flags describe the model (a script may define none of Megatron-LM's)."""
    return all(getattr(args, name, None) is not None for name in MODEL_SHAPE_FLAGS)


def model_dims_from_args(args) -> ModelDims:
    """The planner's ModelDims from Megatron-LM's model flags."""
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    try:
        return ModelDims(num_layers=int(args.num_layers), hidden_size=int(args.hidden_size),
                         num_attention_heads=int(args.num_attention_heads),
                         ffn_hidden_size=int_or_none(getattr(args, "ffn_hidden_size", None)),
                         num_query_groups=int_or_none(groups),
                         gated_linear_unit=bool(getattr(args, "swiglu", False)),
                         # Megatron-LM pads the tokenizer's vocabulary (padded_vocab_size);
                         # scripts without a tokenizer give --vocab-size. It prices the embedding
                         # and the output layer (edge costs); unknown means none.
                         vocab_size=int_or_none(getattr(args, "padded_vocab_size", None)
                                                or getattr(args, "vocab_size", None)),
                         name="this model")
    except (AttributeError, TypeError) as exc:
        raise TeraPipeArgumentError(
            f"planning needs the model shape (--num-layers, --hidden-size, --num-attention-heads): "
            f"{exc}; or give --terapipe-slices / --terapipe-num-slices") from None


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        try:
            return torch.cuda.get_device_name()
        except Exception:  # pragma: no cover
            return "cuda"
    return f"cpu ({platform.machine()}, {platform.processor() or 'unknown'})"
