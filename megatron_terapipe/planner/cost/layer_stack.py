"""LayerStackCostModel: a stage of identical GPT layers. Subclasses give one layer's seconds;
this class scales them, and prices memory, transfers and deferred weight gradients from the
model shape."""

from __future__ import annotations

import copy
from abc import abstractmethod
from typing import Optional

import numpy as np

from .arrays import as_float_arrays, broadcast_shape, scalar_or_array
from .cost_model import CostModel, combine_edges
from .dims import LayerMemory, Link, ModelDims
from .recompute_time import FullRecompute


class LayerStackCostModel(CostModel):
    """A stage of `layers_per_stage` identical layers; memory and transfer from the model shape.

    Subclasses give forward and backward seconds of ONE layer; this class scales them. Edge
    costs come from `edge_part_time` (zero here; the analytic and profiled models override it).
    """

    def __init__(self, model: ModelDims, layers_per_stage: int, link: Link,
                 tensor_parallel: int = 1, dtype_bytes: int = 2, flash_attention: bool = True,
                 sequence_parallel: bool = False):
        if layers_per_stage <= 0:
            raise ValueError(f"layers_per_stage must be positive, got {layers_per_stage}")
        if tensor_parallel <= 0:
            raise ValueError(f"tensor_parallel must be positive, got {tensor_parallel}")
        if model.num_attention_heads % tensor_parallel:
            raise ValueError(
                f"tensor-parallel size {tensor_parallel} does not divide the "
                f"{model.num_attention_heads} attention heads")
        self.model = model
        self.layers_per_stage = int(layers_per_stage)
        self.link = link
        self.tensor_parallel = int(tensor_parallel)
        self.dtype_bytes = int(dtype_bytes)
        # Megatron turns --sequence-parallel off without tensor parallelism
        self.sequence_parallel = bool(sequence_parallel) and self.tensor_parallel > 1
        self.memory = LayerMemory(model, self.tensor_parallel, self.dtype_bytes, flash_attention,
                                  self.sequence_parallel)
        self.flash_attention = flash_attention
        self.gather_link: Optional[Link] = None  # set by with_scatter_gather
        self.recompute: Optional[FullRecompute] = None  # set by with_recompute

    def with_recompute(self, recompute: Optional[FullRecompute]) -> "LayerStackCostModel":
        """This model with Megatron's full recomputation (recompute_time.py): each backward reruns
        the forward of the recomputed layers of its chunk."""
        out = copy.copy(self)
        out.recompute = recompute
        return out

    def recomputed_share(self, share: float = 1.0) -> float:
        if self.recompute is None:
            return 0.0
        return self.recompute.fraction(max(1, round(self.layers_per_stage * share)))

    def with_scatter_gather(self, gather_link: Link) -> "LayerStackCostModel":
        """This model with scatter-gather messages (--terapipe-scatter-gather-p2p): each TP
        rank sends 1/TP of a message over the pipeline link, and the receiving TP ranks
        all-gather it over `gather_link` (inside a node). Without TP, or with sequence
        parallelism (its messages are split already), messages stay as they are."""
        out = copy.copy(self)
        out.gather_link = gather_link if self.tensor_parallel > 1 and not self.sequence_parallel else None
        return out

    def without_scatter_gather(self) -> "LayerStackCostModel":
        if self.gather_link is None:
            return self
        out = copy.copy(self)
        out.gather_link = None
        return out

    @property
    def sequence_split(self) -> int:
        """What sequence parallelism divides a stage's token rows by (1 without it)."""
        return self.tensor_parallel if self.sequence_parallel else 1

    def parallelism_text(self) -> str:
        """TP size (and sequence parallelism) for describe()."""
        return f"TP={self.tensor_parallel}" + (", sequence parallel" if self.sequence_parallel else "") + (
            ", scatter-gather messages" if self.gather_link is not None else "") + (
            f", {self.recompute.text()}" if self.recompute is not None else "")

    @abstractmethod
    def layer_forward_time(self, batch: np.ndarray, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        ...

    @abstractmethod
    def layer_backward_time(self, batch: np.ndarray, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        ...

    def forward_time(self, batch, length, context):
        return scalar_or_array(self.layers_per_stage * self.layer_forward_time(*as_float_arrays(batch, length, context)))

    def backward_time(self, batch, length, context):
        return scalar_or_array(self.layers_per_stage * self.layer_backward_time(*as_float_arrays(batch, length, context)))

    def _message_bytes(self, batch, length) -> np.ndarray:
        """What one TP rank sends per message: the stage's output, its own rows of it under
        sequence parallelism (Megatron's P2P shape is then seq_length / TP), 1/TP of it with
        scatter-gather messages."""
        b, l = as_float_arrays(batch, length)
        split = self.tensor_parallel if self.gather_link is not None else self.sequence_split
        return b * l * self.model.hidden_size * self.dtype_bytes / split

    def transfer_time(self, batch, length):
        """One P2P message over the pipeline link (see _message_bytes)."""
        return scalar_or_array(self.link.time(self._message_bytes(batch, length)))

    def receive_time(self, batch, length):
        """With scatter-gather messages, the receiving TP ranks' ring all-gather of the parts
        (TP - 1 steps of a part over the gather link): the runtime runs it where the cell takes
        its input (runtime/comm/scatter_gather.py), so it is the stage's time, not the link's."""
        if self.gather_link is None:
            return super().receive_time(batch, length)
        part = self._message_bytes(batch, length)
        return scalar_or_array((self.tensor_parallel - 1) * self.gather_link.time(part))

    def activation_bytes(self, batch, length, context):
        return scalar_or_array(self.layers_per_stage * self.memory.activation_bytes(batch, length, context))

    def kv_bytes(self, batch, length):
        return scalar_or_array(self.layers_per_stage * self.memory.kv_bytes(batch, length))

    def edge_part_time(self, part: str, direction: str, batch: np.ndarray,
                       length: np.ndarray) -> np.ndarray:
        """Seconds of one edge part ("embedding": first stage; "output": final norm, output
        layer and loss on the last stage) in one direction ("forward" / "backward")."""
        return np.zeros(np.broadcast(batch, length).shape)

    def _edge_time(self, direction, batch, length, first_stage, last_stage):
        b, l = as_float_arrays(batch, length)
        shape = broadcast_shape(b, l, first_stage, last_stage)
        return combine_edges(first_stage, last_stage, self.edge_part_time("embedding", direction, b, l),
                              self.edge_part_time("output", direction, b, l), shape)

    def edge_forward_time(self, batch, length, first_stage, last_stage):
        return self._edge_time("forward", batch, length, first_stage, last_stage)

    def edge_backward_time(self, batch, length, first_stage, last_stage):
        return self._edge_time("backward", batch, length, first_stage, last_stage)

    def wgrad_hold_bytes(self, batch, length):
        """Per layer: the inputs of QKV, projection, fc1 and fc2, and their output gradients;
        the hidden-sized ones that TP replicates are this rank's rows under sequence parallelism
        (the W action gathers them)."""
        b, l = as_float_arrays(batch, length)
        m, t, sp = self.model, self.tensor_parallel, self.sequence_split
        fc1_out = (2 if m.gated_linear_unit else 1) * m.ffn
        inputs = 3 * m.hidden_size / sp + m.ffn / t
        outputs = (m.hidden_size + 2 * m.kv_hidden) / t + 2 * m.hidden_size / sp + fc1_out / t
        return scalar_or_array(self.layers_per_stage * b * l * (inputs + outputs) * self.dtype_bytes)

    def layer_wgrad_time(self, batch, length, context):
        """One layer's weight-gradient GEMMs, estimated. They repeat the linear layers'
        forward GEMMs (same FLOPs, same shapes), so they take about the linear layers' share of
        the forward time of the slice without context; their FLOP share of the backward (which
        does twice the forward FLOPs) bounds that, where attention's backward is as efficient
        as the GEMMs. (By FLOPs alone, an attention backward slower per FLOP than the GEMMs,
        as on CPUs, would inflate the share.) A profiled cost model measures them instead."""
        b, l, c = as_float_arrays(batch, length, context)
        linear = self.model.linear_flops(b, l)
        attention = self.model.attention_flops(b, l, c, self.flash_attention)
        by_flops = self.layer_backward_time(b, l, c) * linear / (2.0 * (linear + attention))
        no_context = self.model.attention_flops(b, l, 0.0, self.flash_attention)
        by_forward = self.layer_forward_time(b, l, 0.0) * linear / (linear + no_context)
        return np.minimum(by_flops, by_forward)

    def layer_deferred_backward_saving(self, batch, length, context):
        """What deferring saves one layer's backward: by default its weight-gradient GEMMs."""
        return self.layer_wgrad_time(batch, length, context)

    def wgrad_time(self, batch, length, context, first_stage, last_stage):
        """The weight-gradient GEMMs of a cell's backward: its layers', and on the last stage
        the output layer's, whose backward is half weight gradient."""
        return self._stage_wgrad(self.layer_wgrad_time, batch, length, context, first_stage, last_stage)

    def deferred_backward_saving(self, batch, length, context, first_stage, last_stage):
        return self._stage_wgrad(self.layer_deferred_backward_saving, batch, length, context,
                                 first_stage, last_stage)

    def _stage_wgrad(self, per_layer, batch, length, context, first_stage, last_stage):
        b, l, c = as_float_arrays(batch, length, context)
        layers = self.layers_per_stage * per_layer(b, l, c)
        output = 0.5 * self.edge_part_time("output", "backward", b, l)
        shape = broadcast_shape(b, l, c, first_stage, last_stage)
        return scalar_or_array(np.broadcast_to(
            layers + np.where(np.asarray(last_stage, dtype=bool), output, 0.0), shape))
