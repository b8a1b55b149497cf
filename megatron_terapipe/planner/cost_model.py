"""Cost models: how long one pipeline stage takes on one cell, and what it keeps in memory.

A cell is `batch` rows by `length` new tokens, with `context` earlier tokens of the same rows
whose keys and values it attends to. Every method is vectorised: arguments broadcast like numpy
arrays, and a call with plain numbers returns a plain float.

Edge costs: forward_time and backward_time are the same on every stage (the stage's transformer
layers). The first stage also runs the embedding and the last stage the output layer and the
loss, once per cell; `edge_forward_time` / `edge_backward_time` give those extra seconds (zero
unless a model knows them). The simulator adds them on the first and last stage; the slicer
prices each cell on the slowest kind of stage (layers plus the heavier edge).

Implementations here:
- AnalyticCostModel: FLOP and byte counts of a GPT layer on a named GPU type (no measurements).
- FunctionCostModel: wraps your own functions (tests, quick what-ifs).
ProfiledCostModel (profiled.py) fits measurements of a real Megatron layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

ArrayLike = Union[int, float, np.ndarray]


def _scalar_or_array(x: np.ndarray) -> Union[float, np.ndarray]:
    """Plain float for 0-d results so scalar callers get scalars back."""
    x = np.asarray(x, dtype=np.float64)
    return float(x) if x.ndim == 0 else x


def _f64(*xs: ArrayLike) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(x, dtype=np.float64) for x in xs)


class CostModel(ABC):
    """Seconds and bytes of one pipeline stage (all its layers) for one cell."""

    @abstractmethod
    def forward_time(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike):
        """Seconds of the stage's forward pass over the cell."""

    @abstractmethod
    def backward_time(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike):
        """Seconds of the stage's backward pass over the cell (input and weight gradients)."""

    def slice_time(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike):
        """Forward plus backward: the t(l, c) of the TeraPipe paper for one stage."""
        return _scalar_or_array(np.asarray(self.forward_time(batch, length, context))
                                + np.asarray(self.backward_time(batch, length, context)))

    @abstractmethod
    def transfer_time(self, batch: ArrayLike, length: ArrayLike):
        """Seconds to send one cell's activation [length, batch, hidden] to the next stage
        (the gradient going back has the same size and takes the same time)."""

    @abstractmethod
    def activation_bytes(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike):
        """Bytes one stage keeps from a cell's forward until its backward (K/V excluded)."""

    @abstractmethod
    def kv_bytes(self, batch: ArrayLike, length: ArrayLike):
        """Bytes of the cell's keys and values one stage keeps for later token slices."""

    def edge_forward_time(self, batch: ArrayLike, length: ArrayLike, first_stage: ArrayLike,
                          last_stage: ArrayLike):
        """Seconds a cell's forward costs on top of forward_time on the first stage (embedding)
        and/or the last stage (output layer and loss): both on a one-stage pipeline, neither on a
        middle stage. The default is 0 (layers only, as before edge costs existed)."""
        return _scalar_or_array(np.zeros(_edge_shape(batch, length, first_stage, last_stage)))

    def edge_backward_time(self, batch: ArrayLike, length: ArrayLike, first_stage: ArrayLike,
                           last_stage: ArrayLike):
        """Backward counterpart of edge_forward_time (default 0)."""
        return _scalar_or_array(np.zeros(_edge_shape(batch, length, first_stage, last_stage)))

    def wgrad_time(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike,
                   first_stage: ArrayLike, last_stage: ArrayLike):
        """Seconds of a cell's backward (layers plus edges) that are weight-gradient GEMMs.

        With deferred weight gradients (TeraPipePlan.defer_wgrad) a backward cell costs this
        much less, and the sequence's W action costs the sum over its cells. The default is 0:
        the model cannot tell, and deferring is priced as a reordering only."""
        return _scalar_or_array(np.zeros(_edge_shape(batch, length, context, first_stage, last_stage)))

    def deferred_backward_saving(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike,
                                 first_stage: ArrayLike, last_stage: ArrayLike):
        """Seconds a backward cell saves when its weight gradients are deferred. Default: their
        GEMMs' time (`wgrad_time`); a profile that measured deferred backward cells knows better
        (a short slice's W costs more as its own action than inside the backward)."""
        return self.wgrad_time(batch, length, context, first_stage, last_stage)

    def wgrad_hold_bytes(self, batch: ArrayLike, length: ArrayLike):
        """Bytes a stage keeps from a cell's backward until its sequence's W action when weight
        gradients are deferred: the linear layers' inputs and output gradients (default 0)."""
        return _scalar_or_array(np.zeros(_edge_shape(batch, length)))

    def describe(self) -> str:
        return type(self).__name__


EDGE_PARTS = ("embedding", "output")  # first stage; last stage (final norm, output layer, loss)


def _edge_shape(*xs: ArrayLike) -> tuple[int, ...]:
    return np.broadcast(*(np.asarray(x) for x in xs)).shape


def _combine_edges(first_stage: ArrayLike, last_stage: ArrayLike, embedding: np.ndarray,
                   output: np.ndarray, shape: tuple[int, ...]) -> Union[float, np.ndarray]:
    """embedding where first_stage, plus output where last_stage, broadcast to `shape`."""
    first = np.asarray(first_stage, dtype=bool)
    last = np.asarray(last_stage, dtype=bool)
    total = np.where(first, embedding, 0.0) + np.where(last, output, 0.0)
    return _scalar_or_array(np.broadcast_to(total, shape))


# ---- model shape and hardware ---------------------------------------------------------------

@dataclass(frozen=True)
class ModelDims:
    """Shape of a GPT decoder (what the per-layer cost depends on)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size, as in GPT-3
    num_query_groups: Optional[int] = None  # None: one K/V head per query head (no GQA)
    gated_linear_unit: bool = False  # SwiGLU-style MLP: fc1 produces 2 * ffn_hidden_size
    name: str = "custom"
    # Rows of the embedding table and columns of the output layer. None: unknown, and the
    # embedding / output-layer / loss costs of the first and last stage count as zero. Megatron
    # pads the tokenizer's vocabulary to a multiple of 128 x TP (GPT-2 BPE: 50257 -> 50304 at
    # TP=1, 51200 at TP=8); give the padded size to count exactly what runs.
    vocab_size: Optional[int] = None

    def __post_init__(self) -> None:
        for what in ("num_layers", "hidden_size", "num_attention_heads"):
            if int(getattr(self, what)) <= 0:
                raise ValueError(f"ModelDims.{what} must be positive, got {getattr(self, what)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size <= 0:
            raise ValueError(f"ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        if self.vocab_size is not None and int(self.vocab_size) <= 0:
            raise ValueError(f"ModelDims.vocab_size must be positive, got {self.vocab_size}")
        if self.num_query_groups is not None and (
                self.num_query_groups <= 0 or self.num_attention_heads % self.num_query_groups):
            raise ValueError(
                f"num_query_groups {self.num_query_groups} must divide num_attention_heads "
                f"{self.num_attention_heads}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): K/V heads times head size."""
        groups = self.num_query_groups or self.num_attention_heads
        return groups * self.head_dim

    @property
    def params_per_layer(self) -> int:
        h, f = self.hidden_size, self.ffn
        mlp = (3 if self.gated_linear_unit else 2) * h * f
        return h * (h + 2 * self.kv_hidden) + h * h + mlp

    def linear_flops(self, batch: ArrayLike, length: ArrayLike) -> np.ndarray:
        """Forward FLOPs of one layer's linear layers (QKV, projection, MLP)."""
        b, l = _f64(batch, length)
        return 2.0 * b * l * self.params_per_layer

    def attention_flops(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike,
                        flash_attention: bool = True) -> np.ndarray:
        """Forward FLOPs of one layer's core attention (Q K^T and P V)."""
        b, l, c = _f64(batch, length, context)
        if flash_attention:  # fused kernels skip the masked half of the causal block
            pairs = l * c + l * (l + 1) / 2
        else:  # unfused attention computes the whole [l, c + l] score matrix
            pairs = l * (c + l)
        return 4.0 * b * self.hidden_size * pairs

    def to_dict(self) -> dict:
        """The layer shape (and vocab_size when known; left out when None, so the dict of a
        model without one is what it was before vocab_size existed)."""
        out = {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
               "num_attention_heads": self.num_attention_heads, "ffn_hidden_size": self.ffn,
               "num_query_groups": self.num_query_groups or self.num_attention_heads,
               "gated_linear_unit": self.gated_linear_unit}
        if self.vocab_size is not None:
            out["vocab_size"] = int(self.vocab_size)
        return out


@dataclass(frozen=True)
class Link:
    """A point-to-point connection between two pipeline stages."""

    bandwidth: float  # bytes/s in one direction
    latency: float  # seconds per message

    def time(self, nbytes: ArrayLike) -> np.ndarray:
        return self.latency + np.asarray(nbytes, dtype=np.float64) / self.bandwidth


@dataclass(frozen=True)
class Hardware:
    """One GPU type in a node type; see presets.py for the sources of the figures."""

    name: str
    peak_flops: float  # dense fp16/bf16 tensor-core FLOP/s per GPU
    memory_bandwidth: float  # HBM bytes/s per GPU
    memory_bytes: float  # HBM capacity per GPU
    gpus_per_node: int
    intra_node: Link  # GPU to GPU inside a node
    inter_node: Link  # GPU to GPU across nodes, per GPU's share of the node's network
    matmul_efficiency: float = 0.6  # fraction of peak large GEMMs reach
    saturation_tokens: int = 256  # rows x tokens at which a layer's GEMMs reach that efficiency
    layer_overhead: float = 20e-6  # fixed seconds per layer forward (kernel launches etc.)


# ---- memory held per layer (shared by the analytic and the profiled models) ----------------

@dataclass(frozen=True)
class LayerMemory:
    """Bytes a GPT layer keeps for backward, after Korthikanti et al. 2022 ("Reducing
    activation recomputation in large transformer models", section 4.1), split so that K and V
    are counted apart (a token slice's K/V outlive its other activations)."""

    model: ModelDims
    tensor_parallel: int = 1
    dtype_bytes: int = 2
    flash_attention: bool = True  # fused attention keeps no score matrix

    def activation_bytes(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike) -> np.ndarray:
        b, l, c = _f64(batch, length, context)
        m, t, d = self.model, self.tensor_parallel, self.dtype_bytes
        h, f = m.hidden_size, m.ffn
        # Replicated over TP ranks: inputs of LN1, QKV, LN2 and FC1, plus two 1-byte dropout masks.
        replicated = (4 * d + 2) * h
        # Split over TP ranks: Q and the attention output; FC1 output and activation output.
        fc1_saved = (3 if m.gated_linear_unit else 2) * d * f
        split = (2 * d * h + fc1_saved) / t
        per_token_row = b * l * (replicated + split)
        if self.flash_attention:
            scores = b * l * m.num_attention_heads * 4.0 / t  # fp32 log-sum-exp per query row
        else:
            # softmax output, its dropout mask and dropout output over all keys (l + c) per query
            scores = (2 * d + 1) * m.num_attention_heads * b * l * (l + c) / t
        return np.broadcast_to(per_token_row + scores, np.broadcast(b, l, c).shape)

    def kv_bytes(self, batch: ArrayLike, length: ArrayLike) -> np.ndarray:
        b, l = _f64(batch, length)
        return 2.0 * b * l * self.model.kv_hidden * self.dtype_bytes / self.tensor_parallel


class LayerStackCostModel(CostModel):
    """A stage of `layers_per_stage` identical layers; memory and transfer from the model shape.

    Subclasses give forward and backward seconds of ONE layer; this class scales them. Edge
    costs come from `edge_part_time` (zero here; the analytic and profiled models override it).
    """

    def __init__(self, model: ModelDims, layers_per_stage: int, link: Link,
                 tensor_parallel: int = 1, dtype_bytes: int = 2, flash_attention: bool = True):
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
        self.memory = LayerMemory(model, self.tensor_parallel, self.dtype_bytes, flash_attention)
        self.flash_attention = flash_attention

    @abstractmethod
    def layer_forward_time(self, batch: np.ndarray, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        ...

    @abstractmethod
    def layer_backward_time(self, batch: np.ndarray, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        ...

    def forward_time(self, batch, length, context):
        return _scalar_or_array(self.layers_per_stage * self.layer_forward_time(*_f64(batch, length, context)))

    def backward_time(self, batch, length, context):
        return _scalar_or_array(self.layers_per_stage * self.layer_backward_time(*_f64(batch, length, context)))

    def transfer_time(self, batch, length):
        b, l = _f64(batch, length)
        return _scalar_or_array(self.link.time(b * l * self.model.hidden_size * self.dtype_bytes))

    def activation_bytes(self, batch, length, context):
        return _scalar_or_array(self.layers_per_stage * self.memory.activation_bytes(batch, length, context))

    def kv_bytes(self, batch, length):
        return _scalar_or_array(self.layers_per_stage * self.memory.kv_bytes(batch, length))

    def edge_part_time(self, part: str, direction: str, batch: np.ndarray,
                       length: np.ndarray) -> np.ndarray:
        """Seconds of one edge part ("embedding": first stage; "output": final norm, output
        layer and loss on the last stage) in one direction ("forward" / "backward")."""
        return np.zeros(np.broadcast(batch, length).shape)

    def _edge_time(self, direction, batch, length, first_stage, last_stage):
        b, l = _f64(batch, length)
        shape = _edge_shape(b, l, first_stage, last_stage)
        return _combine_edges(first_stage, last_stage, self.edge_part_time("embedding", direction, b, l),
                              self.edge_part_time("output", direction, b, l), shape)

    def edge_forward_time(self, batch, length, first_stage, last_stage):
        return self._edge_time("forward", batch, length, first_stage, last_stage)

    def edge_backward_time(self, batch, length, first_stage, last_stage):
        return self._edge_time("backward", batch, length, first_stage, last_stage)

    def wgrad_hold_bytes(self, batch, length):
        """Per layer: the inputs of QKV, projection, fc1 and fc2, and their output gradients."""
        b, l = _f64(batch, length)
        m, t = self.model, self.tensor_parallel
        fc1_out = (2 if m.gated_linear_unit else 1) * m.ffn
        inputs = 3 * m.hidden_size + m.ffn / t
        outputs = (m.hidden_size + 2 * m.kv_hidden) / t + 2 * m.hidden_size + fc1_out / t
        return _scalar_or_array(self.layers_per_stage * b * l * (inputs + outputs) * self.dtype_bytes)

    def layer_wgrad_time(self, batch, length, context):
        """One layer's weight-gradient GEMMs, estimated. They repeat the linear layers'
        forward GEMMs (same FLOPs, same shapes), so they take about the linear layers' share of
        the forward time of the slice without context; their FLOP share of the backward (which
        does twice the forward FLOPs) bounds that, where attention's backward is as efficient
        as the GEMMs. (By FLOPs alone, an attention backward slower per FLOP than the GEMMs,
        as on CPUs, would inflate the share.) A profiled cost model measures them instead."""
        b, l, c = _f64(batch, length, context)
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
        b, l, c = _f64(batch, length, context)
        layers = self.layers_per_stage * per_layer(b, l, c)
        output = 0.5 * self.edge_part_time("output", "backward", b, l)
        shape = _edge_shape(b, l, c, first_stage, last_stage)
        return _scalar_or_array(np.broadcast_to(
            layers + np.where(np.asarray(last_stage, dtype=bool), output, 0.0), shape))


class AnalyticCostModel(LayerStackCostModel):
    """Roofline estimate of a GPT layer: max(FLOPs / achievable FLOP/s, bytes / HBM bandwidth),
    plus a fixed per-layer overhead and, with tensor parallelism, its all-reduces.

    Short slices use GPUs poorly: the achievable FLOP/s ramps up linearly with rows x tokens
    until `hardware.saturation_tokens`, so a 1-token slice costs about as much as a slice of
    `saturation_tokens` tokens (the TeraPipe paper's observation on V100).
    Backward counts twice the forward FLOPs and bytes (input and weight gradients).

    Edge costs, when `model.vocab_size` is known (zero otherwise): the last stage's output layer
    is a hidden -> vocab GEMM of 2 b l h V / t FLOPs forward and twice that backward, plus the
    logits' traffic through the loss, on the same roofline as the layers; the first stage's
    embedding is a memory-bound gather forward and, backward, a dense gradient of the whole
    table accumulated into the fp32 main gradient (see edge_flops and edge_bytes).
    """

    def __init__(self, model: ModelDims, hardware: Hardware, layers_per_stage: int,
                 tensor_parallel: int = 1, dtype_bytes: int = 2, flash_attention: bool = True,
                 inter_node: bool = False):
        link = hardware.inter_node if inter_node else hardware.intra_node
        super().__init__(model, layers_per_stage, link, tensor_parallel, dtype_bytes, flash_attention)
        self.hardware = hardware
        self.flash_attention = flash_attention
        self.inter_node = inter_node

    def layer_flops(self, batch, length, context) -> np.ndarray:
        """Forward FLOPs of one layer on one tensor-parallel rank."""
        m = self.model
        return (m.linear_flops(batch, length)
                + m.attention_flops(batch, length, context, self.flash_attention)) / self.tensor_parallel

    def layer_bytes(self, batch, length, context) -> np.ndarray:
        """Forward HBM traffic of one layer on one rank: weights, K/V read, activations."""
        b, l, c = _f64(batch, length, context)
        m, t, d = self.model, self.tensor_parallel, self.dtype_bytes
        weights = m.params_per_layer * d / t
        kv_read = 2 * b * (c + l) * m.kv_hidden * d / t
        # each activation tensor written once and read once, roughly
        activations = 2 * b * l * d * (4 * m.hidden_size + 2 * m.ffn / t)
        return weights + kv_read + activations

    def _tp_allreduce_time(self, b, l) -> np.ndarray:
        t = self.tensor_parallel
        if t == 1:
            return np.zeros(np.broadcast(b, l).shape)
        nbytes = b * l * self.model.hidden_size * self.dtype_bytes
        link = self.hardware.intra_node
        # ring all-reduce moves 2 (t-1)/t of the buffer per rank; two all-reduces per layer pass
        return 2 * (2 * (t - 1) * link.latency + 2 * (t - 1) / t * nbytes / link.bandwidth)

    def _roofline(self, b, l, c, scale: float) -> np.ndarray:
        hw = self.hardware
        utilisation = hw.matmul_efficiency * np.minimum(1.0, np.maximum(b * l, 1.0) / hw.saturation_tokens)
        compute = scale * self.layer_flops(b, l, c) / (hw.peak_flops * utilisation)
        memory = scale * self.layer_bytes(b, l, c) / hw.memory_bandwidth
        return (np.maximum(compute, memory) + scale * hw.layer_overhead
                + self._tp_allreduce_time(b, l))

    def layer_forward_time(self, batch, length, context):
        return self._roofline(batch, length, context, 1.0)

    # ---- edges: embedding (first stage), output layer and loss (last stage) ----------------
    def edge_flops(self, part: str, batch, length) -> np.ndarray:
        """Forward FLOPs of an edge part on one tensor-parallel rank (backward: twice that).

        output: the hidden -> vocab GEMM, 2 b l h V / t (the loss's few FLOPs per logit are
        counted as memory traffic). embedding: a gather, no FLOPs to speak of: 0.
        """
        b, l = _f64(batch, length)
        V = self.model.vocab_size
        if part == "embedding" or V is None:
            return np.zeros(np.broadcast(b, l).shape)
        if part != "output":
            raise ValueError(f"edge part must be 'embedding' or 'output', got {part!r}")
        return 2.0 * b * l * self.model.hidden_size * V / self.tensor_parallel

    def edge_bytes(self, part: str, direction: str, batch, length) -> np.ndarray:
        """Memory traffic of an edge part on one rank, d bytes per element, rough pass counts:

        embedding forward: read the gathered rows, write [l, b, h]: 2 b l h d.
        embedding backward: read the incoming gradient and scatter it into a dense gradient of
            the table (3 b l h d), which is written whole and then added to the fp32 main
            gradient: V h (2 d + 8) / t. This per-cell constant is why slicing costs the first
            stage more than its tokens.
        output forward: the weight (V h d / t), the input (b l h d), the logits written once and
            passed over about five times in fp32 by the loss: b l V (d + 20) / t.
        output backward: the weight read and its gradient written and accumulated in fp32
            (V h (2 d + 8) / t), the input and its gradient (2 b l h d), the logits' gradient
            (b l V (2 d + 8) / t).
        """
        b, l = _f64(batch, length)
        m, t, d = self.model, self.tensor_parallel, self.dtype_bytes
        h, V = m.hidden_size, m.vocab_size
        if V is None:
            return np.zeros(np.broadcast(b, l).shape)
        table = V * h / t
        if part == "embedding":
            if direction == "forward":
                return 2.0 * b * l * h * d
            return 3.0 * b * l * h * d + table * (2 * d + 8)
        if part == "output":
            if direction == "forward":
                return table * d + b * l * h * d + b * l * V * (d + 20) / t
            return table * (2 * d + 8) + 2.0 * b * l * h * d + b * l * V * (2 * d + 8) / t
        raise ValueError(f"edge part must be 'embedding' or 'output', got {part!r}")

    def _allreduces(self, nbytes, count: int) -> np.ndarray:
        """`count` ring all-reduces of `nbytes` each over the TP group (0 without TP)."""
        t = self.tensor_parallel
        if t == 1:
            return np.zeros(np.shape(nbytes))
        link = self.hardware.intra_node
        return count * (2 * (t - 1) * link.latency + 2 * (t - 1) / t * nbytes / link.bandwidth)

    def edge_part_time(self, part, direction, batch, length):
        b, l = _f64(batch, length)
        if self.model.vocab_size is None:
            return np.zeros(np.broadcast(b, l).shape)
        hw = self.hardware
        scale = 1.0 if direction == "forward" else 2.0
        utilisation = hw.matmul_efficiency * np.minimum(1.0, np.maximum(b * l, 1.0) / hw.saturation_tokens)
        compute = scale * self.edge_flops(part, b, l) / (hw.peak_flops * utilisation)
        memory = self.edge_bytes(part, direction, b, l) / hw.memory_bandwidth
        activation = b * l * self.model.hidden_size * self.dtype_bytes
        if part == "embedding":  # forward: the vocab-parallel lookup's all-reduce
            comm = self._allreduces(activation, 1) if direction == "forward" else 0.0
        elif direction == "forward":  # the loss's three all-reduces of b l fp32 numbers
            comm = self._allreduces(b * l * 4.0, 3)
        else:  # the column-parallel layer's input gradient
            comm = self._allreduces(activation, 1)
        return np.maximum(compute, memory) + scale * hw.layer_overhead + comm

    def layer_backward_time(self, batch, length, context):
        return self._roofline(batch, length, context, 2.0)

    def describe(self) -> str:
        link = "inter-node" if self.inter_node else "intra-node"
        edges = (f"embedding and output layer of vocab {self.model.vocab_size}"
                 if self.model.vocab_size is not None else "no vocab size: edge costs 0")
        return (f"analytic: {self.model.name} on {self.hardware.name}, {self.layers_per_stage} "
                f"layers/stage, TP={self.tensor_parallel}, {link} pipeline links; {edges}")


class FunctionCostModel(CostModel):
    """A cost model from plain functions of (batch, length, context) arrays.

    forward: seconds of the stage's forward; backward defaults to `backward_ratio` x forward.
    transfer(batch, length), activation(batch, length, context), kv(batch, length) default to
    zero seconds, and one byte per row per token for both memories.
    edge_forward(batch, length, first_stage, last_stage) and edge_backward(...) give the first
    and last stage's extra seconds; both default to zero. wgrad(batch, length, context,
    first_stage, last_stage): the weight-gradient seconds within backward (default zero).
    """

    def __init__(self, forward: Callable[..., ArrayLike],
                 backward: Optional[Callable[..., ArrayLike]] = None, backward_ratio: float = 2.0,
                 transfer: Optional[Callable[..., ArrayLike]] = None,
                 activation: Optional[Callable[..., ArrayLike]] = None,
                 kv: Optional[Callable[..., ArrayLike]] = None,
                 edge_forward: Optional[Callable[..., ArrayLike]] = None,
                 edge_backward: Optional[Callable[..., ArrayLike]] = None,
                 wgrad: Optional[Callable[..., ArrayLike]] = None, name: str = "function"):
        self._forward = forward
        self._backward = backward
        self._backward_ratio = backward_ratio
        self._transfer = transfer
        self._activation = activation
        self._kv = kv
        self._edge_forward = edge_forward
        self._edge_backward = edge_backward
        self._wgrad = wgrad
        self.name = name

    def forward_time(self, batch, length, context):
        b, l, c = _f64(batch, length, context)
        return _scalar_or_array(np.broadcast_to(self._forward(b, l, c), np.broadcast(b, l, c).shape))

    def backward_time(self, batch, length, context):
        b, l, c = _f64(batch, length, context)
        if self._backward is None:
            return _scalar_or_array(self._backward_ratio * np.asarray(self.forward_time(b, l, c)))
        return _scalar_or_array(np.broadcast_to(self._backward(b, l, c), np.broadcast(b, l, c).shape))

    def transfer_time(self, batch, length):
        b, l = _f64(batch, length)
        if self._transfer is None:
            return _scalar_or_array(np.zeros(np.broadcast(b, l).shape))
        return _scalar_or_array(np.broadcast_to(self._transfer(b, l), np.broadcast(b, l).shape))

    def activation_bytes(self, batch, length, context):
        b, l, c = _f64(batch, length, context)
        if self._activation is None:
            return _scalar_or_array(np.broadcast_to(b * l, np.broadcast(b, l, c).shape))
        return _scalar_or_array(np.broadcast_to(self._activation(b, l, c), np.broadcast(b, l, c).shape))

    def kv_bytes(self, batch, length):
        b, l = _f64(batch, length)
        return _scalar_or_array(b * l if self._kv is None else np.asarray(self._kv(b, l), dtype=np.float64))

    def _edge(self, fn, batch, length, first_stage, last_stage):
        if fn is None:
            return CostModel.edge_forward_time(self, batch, length, first_stage, last_stage)
        b, l = _f64(batch, length)
        first, last = np.asarray(first_stage, dtype=bool), np.asarray(last_stage, dtype=bool)
        shape = _edge_shape(b, l, first, last)
        return _scalar_or_array(np.broadcast_to(np.asarray(fn(b, l, first, last), dtype=np.float64), shape))

    def edge_forward_time(self, batch, length, first_stage, last_stage):
        return self._edge(self._edge_forward, batch, length, first_stage, last_stage)

    def edge_backward_time(self, batch, length, first_stage, last_stage):
        return self._edge(self._edge_backward, batch, length, first_stage, last_stage)

    def wgrad_time(self, batch, length, context, first_stage, last_stage):
        if self._wgrad is None:
            return super().wgrad_time(batch, length, context, first_stage, last_stage)
        b, l, c = _f64(batch, length, context)
        first, last = np.asarray(first_stage, dtype=bool), np.asarray(last_stage, dtype=bool)
        shape = _edge_shape(b, l, c, first, last)
        return _scalar_or_array(np.broadcast_to(
            np.asarray(self._wgrad(b, l, c, first, last), dtype=np.float64), shape))

    def describe(self) -> str:
        return self.name
