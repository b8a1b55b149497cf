"""What a pipeline stage keeps in memory: activations and K/V per cell and sequence
(`StageMemory`), and the weights, gradients and optimizer state it holds throughout
(`model_state_bytes`, Megatron's accounting). The simulator walks a schedule's actions with a
StageMemory to get each stage's peak; the search keeps the plans whose peak plus model state
fits a budget.

What a stage keeps, as the runtime keeps it (runtime/attention/kv_cache.py, runtime/attention/slice_attention.py):
- a cell's activations, saved by autograd from its forward until its backward;
- one K/V buffer per (sequence, layer), sized to the whole sequence, from the forward of the
  sequence's first token slice until the backward of that slice (the last to read it); the
  K/V gradient buffers, as large, from the sequence's first backward (its last slice's) until
  then too (a sequence of one slice has no buffers: its K and V are saved with its other
  activations and their gradients live within a layer's backward, as in Megatron's
  attention; the walk counts its K/V as `whole_sequence_kv_bytes`, and no gradient buffers);
- with deferred weight gradients, the linear layers' inputs and output gradients from a
  backward until its sequence's W action.
Megatron's own schedules run whole microbatches through Megatron's attention, which keeps its
K and V among the activations (`microbatch_bytes`).

Implementations: `CostModelMemory` (the cost model's activation_bytes / kv_bytes: the analytic
estimate after Korthikanti et al. 2022) and `FittedMemory` (memory_fit.py: fitted to bytes
measured on the device).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

from .cost_model import CostModel
from .dims import ModelDims

GiB = 1024 ** 3
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str) -> float:
    """'70GiB', '80GB', '1.5TiB', '512MiB', '123456' -> bytes. Raises ValueError."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a size such as 70GiB, 80GB or 512MiB, got {text!r}")
    return float(match.group(1)) * _UNITS[unit]


def format_size(nbytes: float) -> str:
    """'70.00 GiB', '512.0 MiB', '3.0 KiB', '12 B'."""
    for unit, size, digits in (("GiB", GiB, 2), ("MiB", 2 ** 20, 1), ("KiB", 2 ** 10, 1)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.{digits}f} {unit}"
    return f"{nbytes:.0f} B"


class StageMemory(ABC):
    """Bytes one pipeline stage keeps for backward. Scalars in, scalars out.

    `layers` is how many transformer layers run on the stage for the cell (default: all of
    the stage's; an interleaved schedule's model chunk has fewer). `first` / `last`: the cell
    runs the embedding / the output layer and loss (the pipeline's first / last stage)."""

    @abstractmethod
    def cell_bytes(self, rows: int, tokens: int, context: int, first: bool, last: bool,
                   layers: Optional[float] = None) -> float:
        """Activations a TeraPipe cell keeps from its forward to its backward, without the
        sequence's K/V buffers."""

    @abstractmethod
    def kv_buffer_bytes(self, rows: int, seq_length: int, layers: Optional[float] = None) -> float:
        """One sequence's K/V buffers on the stage (every layer, the whole sequence)."""

    def kv_grad_bytes(self, rows: int, seq_length: int, layers: Optional[float] = None) -> float:
        """One sequence's K/V gradient buffers: as large as its K/V."""
        return self.kv_buffer_bytes(rows, seq_length, layers)

    def whole_sequence_kv_bytes(self, rows: int, seq_length: int,
                                layers: Optional[float] = None) -> float:
        """The K/V a sequence of one slice keeps: no buffer, the copies its attention saves
        (as large; recomputation drops a recomputed layer's, recompute_memory.py)."""
        return self.kv_buffer_bytes(rows, seq_length, layers)

    def wgrad_hold_bytes(self, rows: int, tokens: int, first: bool, last: bool,
                         layers: Optional[float] = None) -> float:
        """What a backward cell leaves for its sequence's W action (deferred weight gradients)."""
        return 0.0

    #: Share of a layer's cell activations its backward frees before it allocates the layer's
    #: K/V gradient buffers (the MLP and the attention projection run their backward first),
    #: and the same less what it keeps for the W action when weight gradients are deferred.
    freed_before_kv_grad: float = 0.6
    freed_before_kv_grad_deferred: float = 0.3
    layers_per_stage: int = 1

    def backward_rise(self, rows: int, tokens: int, context: int, seq_length: int, first: bool,
                      last: bool, deferred: bool = False, layers: Optional[float] = None,
                      kv_grads: bool = True) -> float:
        """How far a backward lifts the stage's live bytes above where they were before it.
        Without recomputation only a sequence's first backward (its last slice's,
        `kv_grads`) lifts them, allocating the K/V gradients: from the top, each layer frees
        a share f of its activations a (less what it keeps for the W action), allocates its
        K/V gradients g, then frees the rest, keeping h for the W action; the output layer
        and loss free theirs first (o, less what they keep). The highest point is after
        layer 1 or layer L: max(g - f a, L g - (L - 1)(a - h) - f a) - o, or no rise at all.
        `layers`: L, when the cell runs on fewer than the stage's layers (a model chunk).
        recompute_memory.py walks the same layers with checkpointed groups."""
        if not kv_grads:
            return 0.0
        L = self.layers_per_stage if layers is None else layers
        a, g, h, out, f = self.backward_terms(rows, tokens, context, seq_length, last, deferred, L)
        return max(0.0, max(g - f * a, L * g - (L - 1) * (a - h) - f * a) - out)

    def backward_terms(self, rows: int, tokens: int, context: int, seq_length: int, last: bool,
                       deferred: bool, layers: float, kv_grads: bool = True
                       ) -> tuple[float, float, float, float, float]:
        """What a backward over `layers` layers frees and allocates, per layer: (activations
        a, K/V gradients g (0 without `kv_grads`), what it keeps for the W action h, what the
        output layer and loss free first o, the share f of a freed before g)."""
        L = layers
        no_layers = self.cell_bytes(rows, tokens, context, False, False, 0)
        a = (self.cell_bytes(rows, tokens, context, False, False, L) - no_layers) / L
        out = self.cell_bytes(rows, tokens, context, False, last, 0) - no_layers
        g = self.kv_grad_bytes(rows, seq_length, L) / L if kv_grads else 0.0
        f, h = self.freed_before_kv_grad, 0.0
        if deferred:
            f = self.freed_before_kv_grad_deferred
            h = (self.wgrad_hold_bytes(rows, tokens, False, False, L)
                 - self.wgrad_hold_bytes(rows, tokens, False, False, 0)) / L
            out -= (self.wgrad_hold_bytes(rows, tokens, False, last, 0)
                    - self.wgrad_hold_bytes(rows, tokens, False, False, 0))
        return a, g, h, out, f

    def microbatch_backward_rise(self, rows: int, seq_length: int, first: bool, last: bool,
                                 layers: Optional[float] = None) -> float:
        """How far a backward of Megatron's schedules lifts the live bytes above where they
        were: without recomputation it only frees."""
        return 0.0

    def microbatch_bytes(self, rows: int, seq_length: int, first: bool, last: bool,
                         layers: Optional[float] = None) -> float:
        """What Megatron's own schedules keep per microbatch (whole sequence, Megatron's
        attention). Default: one cell without context plus its K/V."""
        return (self.cell_bytes(rows, seq_length, 0, first, last, layers)
                + self.kv_buffer_bytes(rows, seq_length, layers))

    def describe(self) -> str:
        return type(self).__name__


class CostModelMemory(StageMemory):
    """The cost model's activation_bytes, kv_bytes and wgrad_hold_bytes (a stage of
    `layers_per_stage` layers), with the output layer's logits on the last stage when the
    cost model knows the model's shape and vocabulary (ModelDims.vocab_size)."""

    def __init__(self, cost_model: CostModel):
        self.cost_model = cost_model
        self.layers_per_stage = int(getattr(cost_model, "layers_per_stage", 1))
        self.model: Optional[ModelDims] = getattr(cost_model, "model", None)

    def _share(self, layers: Optional[float]) -> float:
        return 1.0 if layers is None else float(layers) / self.layers_per_stage

    def cell_bytes(self, rows, tokens, context, first, last, layers=None):
        layer_bytes = float(self.cost_model.activation_bytes(rows, tokens, context))
        return layer_bytes * self._share(layers) + (self._output_bytes(rows, tokens) if last else 0.0)

    def kv_buffer_bytes(self, rows, seq_length, layers=None):
        return float(self.cost_model.kv_bytes(rows, seq_length)) * self._share(layers)

    def wgrad_hold_bytes(self, rows, tokens, first, last, layers=None):
        return float(self.cost_model.wgrad_hold_bytes(rows, tokens)) * self._share(layers)

    def _output_bytes(self, rows: int, tokens: int) -> float:
        """Final norm and output layer inputs (16-bit; this rank's rows of them under sequence
        parallelism, the output layer gathering its input again in backward) and the loss's
        float32 softmax."""
        m = self.model
        if m is None or m.vocab_size is None:
            return 0.0
        tp = int(getattr(self.cost_model, "tensor_parallel", 1))
        dtype = int(getattr(self.cost_model, "dtype_bytes", 2))
        split = int(getattr(self.cost_model, "sequence_split", 1))
        return float(rows * tokens * (2 * m.hidden_size * dtype / split + 4 * m.vocab_size / tp))

    def describe(self) -> str:
        return f"from the cost model ({self.cost_model.describe()})"


# ---- weights, gradients and optimizer state: Megatron's accounting ------------------------

@dataclass(frozen=True)
class ModelStateConfig:
    """How Megatron keeps the model's state (megatron/training/theoretical_memory_usage.py):
    16-bit weights, float32 gradients (main_grad) and Adam with float32 master weights and two
    moments: 18 bytes per parameter, or 6 + 12 / DP with the distributed optimizer. float32
    training keeps no master copy: 16, or 8 + 8 / DP."""

    dtype_bytes: int = 2
    data_parallel: int = 1
    distributed_optimizer: bool = False
    tensor_parallel: int = 1
    untie_embeddings: bool = True  # the last stage holds its own output layer

    def bytes_per_parameter(self) -> float:
        weights_and_grads, optimizer = (6.0, 12.0) if self.dtype_bytes < 4 else (8.0, 8.0)
        if self.distributed_optimizer:
            return weights_and_grads + optimizer / self.data_parallel
        return weights_and_grads + optimizer


def stage_parameters(model: ModelDims, layers: int, first: bool, last: bool,
                     tensor_parallel: int = 1, untie_embeddings: bool = True) -> float:
    """Parameters one stage holds on one tensor-parallel rank: its layers (linear weights and
    biases split over TP, layer norms replicated), plus the word embedding on the first stage
    and the output layer and final norm on the last (Megatron keeps a copy of a tied embedding
    there too when the stages differ)."""
    h, t = model.hidden_size, tensor_parallel
    biases = model.hidden_size + 2 * model.kv_hidden + h + model.ffn + h
    per_layer = (model.params_per_layer + biases) / t + 4 * h
    total = layers * per_layer
    vocab = model.vocab_size or 0
    if first:
        total += vocab * h / t
    if last:
        total += 2 * h + (vocab * h / t if (untie_embeddings or not first) else 0.0)
    return float(total)


def model_state_bytes(model: ModelDims, layers_per_stage: int, num_stages: int,
                      config: ModelStateConfig = ModelStateConfig()) -> tuple[float, ...]:
    """Weights, gradients and optimizer state per stage, by Megatron's accounting."""
    per_param = config.bytes_per_parameter()
    return tuple(per_param * stage_parameters(model, layers_per_stage, k == 0, k == num_stages - 1,
                                              config.tensor_parallel, config.untie_embeddings)
                 for k in range(num_stages))


@dataclass(frozen=True)
class MemoryBudget:
    """A per-GPU memory budget (None: no limit) and what each stage holds besides
    activations and K/V (weights, gradients, optimizer state)."""

    budget_bytes: Optional[float]
    model_state: tuple[float, ...] = (0.0,)

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and not self.budget_bytes > 0:
            raise ValueError(f"the memory budget must be positive, got {self.budget_bytes}")

    def state(self, stage: int) -> float:
        return self.model_state[stage] if stage < len(self.model_state) else self.model_state[-1]

    def totals(self, peaks: tuple[float, ...]) -> tuple[float, ...]:
        """Predicted peak per stage: activations and K/V plus the model state."""
        return tuple(p + self.state(k) for k, p in enumerate(peaks))

    def fits(self, peaks: tuple[float, ...]) -> bool:
        return self.budget_bytes is None or max(self.totals(peaks)) <= self.budget_bytes

    def limit_text(self) -> str:
        return ("no memory budget" if self.budget_bytes is None
                else f"budget {format_size(self.budget_bytes)} per GPU")

    def state_text(self) -> str:
        """The model state per stage: one size, or the range over the stages."""
        low, high = format_size(min(self.model_state)), format_size(max(self.model_state))
        return low if high == low else f"{low} to {high}"

    def describe(self) -> str:
        return (f"{self.limit_text()}; weights, gradients and optimizer state "
                f"{self.state_text()} per stage")


class MemoryBudgetError(ValueError):
    """No plan of the search space fits the memory budget."""
