"""The shapes a cost model prices: a GPT decoder's dimensions, the links between stages, a GPU
type, and the bytes a layer keeps for backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .arrays import ArrayLike, as_float_arrays


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
        b, l = as_float_arrays(batch, length)
        return 2.0 * b * l * self.params_per_layer

    def attention_flops(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike,
                        flash_attention: bool = True) -> np.ndarray:
        """Forward FLOPs of one layer's core attention (Q K^T and P V)."""
        b, l, c = as_float_arrays(batch, length, context)
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
    inter_node: Link  # GPU to GPU across nodes: one GPU's message over the network
    gpus_per_nic: int = 1  # GPUs whose traffic shares one inter-node link when all send at once
    # The rest is fitted to published and measured runs (benchmarks/fit_presets.py):
    matmul_efficiency: float = 0.6  # fraction of peak that large GEMMs reach
    gemm_half_rows: float = 256.0  # rows (batch x tokens) at which GEMMs reach half of that
    layer_overhead: float = 20e-6  # fixed seconds per layer forward (launches, the cell's own work)
    prefix_slice_overhead: float = 0.0  # seconds per layer forward per earlier token slice
    dp_exposed: float = 1.0  # share of the data-parallel gradient reduction not overlapped

    def gemm_efficiency(self, rows):
        """Fraction of peak a layer's GEMMs reach on `rows` (batch x tokens) rows: short slices
        use the GPU poorly (E n / (n + n_half))."""
        n = np.maximum(np.asarray(rows, dtype=np.float64), 1.0)
        return self.matmul_efficiency * n / (n + self.gemm_half_rows)


# ---- memory held per layer (shared by the analytic and the profiled models) ----------------

@dataclass(frozen=True)
class LayerMemory:
    """Bytes a GPT layer keeps for backward, after Korthikanti et al. 2022 ("Reducing
    activation recomputation in large transformer models", sections 4.1 and 4.2.2), split so
    that K and V are counted apart (a token slice's K/V outlive its other activations).

    Sequence parallelism (Megatron's --sequence-parallel) splits the tensors that tensor
    parallelism replicates (the norms', the dropouts' and the column-parallel GEMMs' inputs)
    along the sequence over the TP ranks: every term is then divided by the TP size."""

    model: ModelDims
    tensor_parallel: int = 1
    dtype_bytes: int = 2
    flash_attention: bool = True  # fused attention keeps no score matrix
    sequence_parallel: bool = False

    def activation_bytes(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike) -> np.ndarray:
        b, l, c = as_float_arrays(batch, length, context)
        m, t, d = self.model, self.tensor_parallel, self.dtype_bytes
        h, f = m.hidden_size, m.ffn
        # Replicated over TP ranks: inputs of LN1, QKV, LN2 and FC1, plus two 1-byte dropout
        # masks; split along the sequence under sequence parallelism.
        replicated = (4 * d + 2) * h / (t if self.sequence_parallel else 1)
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
        b, l = as_float_arrays(batch, length)
        return 2.0 * b * l * self.model.kv_hidden * self.dtype_bytes / self.tensor_parallel
