"""ProfiledCostModel: layer times measured on a real device (megatron/measure/layers.py), fitted
(planner/profile/least_squares.py) and saved as a layer profile (planner/profile/time_fit.py).

Weight gradients: format-3 profiles measured the W action and what deferring saves the
backward on context-free cells; older profiles estimate both from the forward and backward
(LayerStackCostModel). Edge costs: the first stage's embedding and the last stage's final norm,
output layer and loss come from the profile's edge fit; profiles without one (version 1, or
measured without a vocabulary size) count them as zero.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..cost.arrays import as_float_arrays
from ..cost.dims import Link, ModelDims
from .time_fit import LayerTimeFit, PathLike
from ..cost.layer_stack import LayerStackCostModel


class ProfiledCostModel(LayerStackCostModel):
    """Stage times from a fitted layer profile; memory and transfer from the model shape.

    Edge times (embedding on the first stage; final norm, output layer and loss on the last)
    come from the profile's edge fit, or are zero if it has none (describe() says which).
    """

    def __init__(self, fit: LayerTimeFit, layers_per_stage: int, link: Link,
                 model: Optional[ModelDims] = None, tensor_parallel: Optional[int] = None,
                 dtype_bytes: int = 2, flash_attention: bool = True,
                 sequence_parallel: bool = False):
        if model is None:
            model = _model_from_metadata(fit)
        fit.check_matches(model, tensor_parallel)
        tp = tensor_parallel if tensor_parallel is not None else int(fit.metadata.get("tensor_parallel", 1))
        super().__init__(model, layers_per_stage, link, tp, dtype_bytes, flash_attention,
                         sequence_parallel)
        self.fit = fit

    @classmethod
    def load(cls, path: PathLike, layers_per_stage: int, link: Link,
             model: Optional[ModelDims] = None, tensor_parallel: Optional[int] = None,
             **kwargs) -> "ProfiledCostModel":
        return cls(LayerTimeFit.load(path, model, tensor_parallel), layers_per_stage, link,
                   model=model, tensor_parallel=tensor_parallel, **kwargs)

    def layer_forward_time(self, batch, length, context):
        return self.fit.seconds("forward", batch, length, context)

    def layer_backward_time(self, batch, length, context):
        return self.fit.seconds("backward", batch, length, context)

    def layer_wgrad_time(self, batch, length, context):
        """Measured: the W action's GEMMs for these tokens (they do not depend on the context).
        Profiles without the measurement (format version < 3) use the base class's estimate."""
        if not self.fit.has_wgrad:
            return super().layer_wgrad_time(batch, length, context)
        return self._context_free("wgrad", batch, length)

    def layer_deferred_backward_saving(self, batch, length, context):
        """Measured: the full backward less the deferred one, on context-free cells of these
        tokens. Without the measurement: the W time, as the base class."""
        if not self.fit.has_wgrad:
            return super().layer_deferred_backward_saving(batch, length, context)
        return self._context_free("wgrad_saving", batch, length)

    def _context_free(self, table: str, batch, length):
        b, l = as_float_arrays(batch, length)
        return self.fit.seconds(table, b, l, np.zeros_like(l))

    def edge_part_time(self, part, direction, batch, length):
        if self.fit.edges is None:
            return super().edge_part_time(part, direction, batch, length)
        return self.fit.edges.seconds(part, direction, batch, length)

    def describe(self) -> str:
        md = self.fit.metadata
        return (f"profiled: {md.get('device', '?')} {md.get('dtype', '?')}, "
                f"{self.layers_per_stage} layers/stage, {self.parallelism_text()}; "
                f"{self.fit.edges_note()}")


def _model_from_metadata(fit: LayerTimeFit) -> ModelDims:
    """The model shape a profile was measured for (its metadata), when the caller gives none."""
    meta_model = fit.metadata.get("model", {})
    try:
        return ModelDims(num_layers=int(meta_model.get("num_layers", 1)),
                         hidden_size=int(meta_model["hidden_size"]),
                         num_attention_heads=int(meta_model["num_attention_heads"]),
                         ffn_hidden_size=meta_model.get("ffn_hidden_size"),
                         num_query_groups=meta_model.get("num_query_groups"),
                         gated_linear_unit=bool(meta_model.get("gated_linear_unit", False)),
                         vocab_size=fit.edges.vocab_size if fit.edges is not None else None,
                         name=str(fit.metadata.get("model_name", "profiled")))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"layer profile metadata has no usable model dimensions ({exc})") from None
