"""AnalyticCostModel: a roofline estimate of GPT layers on a named GPU type (no measurements)."""

from __future__ import annotations

import numpy as np

from .arrays import as_float_arrays
from .dims import Hardware, ModelDims
from .layer_stack import LayerStackCostModel


class AnalyticCostModel(LayerStackCostModel):
    """A small physical model of GPT layers on a named GPU type, its parameters fitted to
    published and measured runs (presets.py; benchmarks/fit_presets.py). Per layer and pass:

    - GEMMs and attention: FLOPs / (peak x efficiency), where the efficiency grows with the
      cell's rows (batch x tokens) as E n / (n + n_half): short slices use GPUs poorly; or the
      HBM traffic / bandwidth where that is longer (a roofline);
    - a fixed cost per layer pass (`layer_overhead`: launches and the cell's own work);
    - attention over the K/V prefix: `prefix_slice_overhead` per earlier slice of the cell's
      length (context / length), what handling the cached pieces costs (so a thin slice behind
      a long prefix may cost more than a longer one; the slicer assumes no monotonicity);
    - with tensor parallelism, two all-reduces on the node's link.
    Backward counts twice the forward's compute, traffic and fixed costs. The data-parallel
    gradient reduction, where not overlapped, is `data_parallel_time`.

    Edge costs, when `model.vocab_size` is known (zero otherwise): the last stage's output layer
    is a hidden -> vocab GEMM of 2 b l h V / t FLOPs forward and twice that backward, plus the
    logits' traffic through the loss, on the same roofline as the layers; the first stage's
    embedding is a memory-bound gather forward and, backward, a dense gradient of the whole
    table accumulated into the fp32 main gradient (see edge_flops and edge_bytes).
    """

    def __init__(self, model: ModelDims, hardware: Hardware, layers_per_stage: int,
                 tensor_parallel: int = 1, dtype_bytes: int = 2, flash_attention: bool = True,
                 inter_node: bool = False, sequence_parallel: bool = False):
        link = hardware.inter_node if inter_node else hardware.intra_node
        super().__init__(model, layers_per_stage, link, tensor_parallel, dtype_bytes, flash_attention,
                         sequence_parallel)
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
        b, l, c = as_float_arrays(batch, length, context)
        m, t, d = self.model, self.tensor_parallel, self.dtype_bytes
        weights = m.params_per_layer * d / t
        kv_read = 2 * b * (c + l) * m.kv_hidden * d / t
        # each activation tensor written once and read once, roughly
        activations = 2 * b * l * d * (4 * m.hidden_size + 2 * m.ffn / t)
        return weights + kv_read + activations

    def _tp_allreduce_time(self, b, l) -> np.ndarray:
        """Two all-reduces per layer pass. Under sequence parallelism each is an all-gather and
        a reduce-scatter, the two halves of a ring all-reduce: the same steps and bytes. (The
        backward's second all-gather of the column-parallel GEMMs' inputs, for their weight
        gradients, overlaps the input-gradient GEMM in Megatron; it is not counted.)"""
        t = self.tensor_parallel
        if t == 1:
            return np.zeros(np.broadcast(b, l).shape)
        nbytes = b * l * self.model.hidden_size * self.dtype_bytes
        link = self.hardware.intra_node
        # ring all-reduce moves 2 (t-1)/t of the buffer per rank; two all-reduces per layer pass
        return 2 * (2 * (t - 1) * link.latency + 2 * (t - 1) / t * nbytes / link.bandwidth)

    def _roofline(self, b, l, c, scale: float) -> np.ndarray:
        hw = self.hardware
        compute = scale * self.layer_flops(b, l, c) / (hw.peak_flops * hw.gemm_efficiency(b * l))
        memory = scale * self.layer_bytes(b, l, c) / hw.memory_bandwidth
        prefix = scale * hw.prefix_slice_overhead * c / np.maximum(l, 1.0)
        return (np.maximum(compute, memory) + scale * hw.layer_overhead + prefix
                + self._tp_allreduce_time(b, l))

    def data_parallel_time(self, data_parallel: int) -> float:
        """Seconds per iteration of the gradient all-reduce over `data_parallel` ranks on
        other nodes (a ring on the inter-node link, which `gpus_per_nic` GPUs of a node share
        while all of them reduce), for the stage holding the most parameters (its layers, and
        the embedding or output layer on the first or last stage), times the share not
        overlapped with the backward (`dp_exposed`); 0 without data parallelism."""
        d = int(data_parallel)
        if d <= 1:
            return 0.0
        hw, m = self.hardware, self.model
        params = self.layers_per_stage * m.params_per_layer + (m.vocab_size or 0) * m.hidden_size
        nbytes = params / self.tensor_parallel * self.dtype_bytes
        bandwidth = hw.inter_node.bandwidth / hw.gpus_per_nic
        ring = 2 * (d - 1) * hw.inter_node.latency + 2 * (d - 1) / d * nbytes / bandwidth
        return float(hw.dp_exposed * ring)

    def layer_forward_time(self, batch, length, context):
        return self._roofline(batch, length, context, 1.0)

    # ---- edges: embedding (first stage), output layer and loss (last stage) ----------------
    def edge_flops(self, part: str, batch, length) -> np.ndarray:
        """Forward FLOPs of an edge part on one tensor-parallel rank (backward: twice that).

        output: the hidden -> vocab GEMM, 2 b l h V / t (the loss's few FLOPs per logit are
        counted as memory traffic). embedding: a gather, no FLOPs to speak of: 0.
        """
        b, l = as_float_arrays(batch, length)
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
        b, l = as_float_arrays(batch, length)
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
        b, l = as_float_arrays(batch, length)
        if self.model.vocab_size is None:
            return np.zeros(np.broadcast(b, l).shape)
        hw = self.hardware
        scale = 1.0 if direction == "forward" else 2.0
        compute = scale * self.edge_flops(part, b, l) / (hw.peak_flops * hw.gemm_efficiency(b * l))
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
                f"layers/stage, {self.parallelism_text()}, {link} pipeline links; {edges}")
