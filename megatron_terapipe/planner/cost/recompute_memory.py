"""What Megatron's full recomputation saves in memory, and what its backward rematerialises.

With `--recompute-granularity full` a model chunk's checkpointed groups (recompute_time.py) run
their forward without keeping activations: each group keeps only its input (Megatron's
CheckpointFunction saves the hidden states it was called with), and a backward reruns the
group's forward, so the group's activations exist again while it runs backward. The layers
outside every group keep theirs as before.

`RecomputedMemory` wraps any StageMemory (the cost model's estimate or a measured profile,
both measured or estimated without recomputation) and answers for the run with it:
- a cell (TeraPipe) or a microbatch (Megatron's schedules) keeps its kept layers'
  activations, one input per group, and its edges (embedding, output layer) as before;
- TeraPipe's K/V buffers stay whole (the slice attention's cache holds every layer's K/V for
  the later slices, recomputed or not; a rerun rewrites its own slice), while Megatron's
  attention, and TeraPipe's on a sequence of one slice (no buffer), keeps its K/V among the
  activations, so a recomputed layer drops them;
- a backward's highest point walks the chunk's layers from the top, as the backward runs
  them: a group's activations come back at its top layer, each layer frees its share before
  its K/V gradients appear (StageMemory.backward_rise) and the rest after.
"""

from __future__ import annotations

from typing import Optional

from .cost_model import CostModel
from .recompute_time import FullRecompute
from .stage_memory import CostModelMemory, StageMemory


def backward_walk(num_layers: int, groups: tuple[tuple[int, int], ...], a: float, x: float,
                  g: float, f: float, h: float, out: float, shared: float = 0.0) -> float:
    """The highest rise of a stage's live bytes during a backward over `num_layers` layers
    (above where they were when it started), from the top layer down: the output layer frees
    `out` first; a checkpointed group's top layer first brings back its group's activations (a
    per layer, less its input x, which it kept, plus `shared`: what the layers keep once for
    all of them, such as the attention mask, where no layer kept it), freed again with the
    group's bottom layer; each layer frees f a, allocates g, then frees the rest of a and
    keeps h for the W action. Without groups this is StageMemory's closed form."""
    top_of = {end - 1: end - first for first, end in groups}
    bottoms = {first for first, _ in groups}
    live, peak = -out, 0.0
    for layer in reversed(range(num_layers)):
        if layer in top_of:
            live += top_of[layer] * a - x + shared
            peak = max(peak, live)
        live += g - f * a
        peak = max(peak, live)
        live -= (1.0 - f) * a - h
        if layer in bottoms:
            live -= shared
    return peak


class RecomputedMemory(StageMemory):
    """`inner`'s bytes for a run with Megatron's full recomputation `recompute`; a group's
    input is `input_bytes_per_token` per token of the cell (hidden size x dtype, split by
    sequence parallelism)."""

    def __init__(self, inner: StageMemory, recompute: FullRecompute, input_bytes_per_token: float):
        self.inner, self.recompute = inner, recompute
        self.input_bytes_per_token = float(input_bytes_per_token)
        self.layers_per_stage = inner.layers_per_stage
        self.freed_before_kv_grad = inner.freed_before_kv_grad
        self.freed_before_kv_grad_deferred = inner.freed_before_kv_grad_deferred

    def _chunk(self, layers: Optional[float]) -> tuple[float, int, tuple[tuple[int, int], ...], int]:
        """(layers L, whole layers n, groups, recomputed layers) of a cell's chunk."""
        L = float(self.layers_per_stage if layers is None else layers)
        n = max(1, round(L))
        groups = self.recompute.groups(n)
        return L, n, groups, sum(end - first for first, end in groups)

    def _kept(self, full: float, edges: float, shared: float, rows: int, tokens: int,
              layers: Optional[float]) -> float:
        """Bytes kept of a chunk that would keep `full` without recomputation: `edges` outside
        its layers (embedding, output layer), of which `shared` is what its layers keep once
        for all of them (kept only while some layer keeps its activations)."""
        L, n, groups, recomputed = self._chunk(layers)
        if L <= 0:
            return full
        inputs = len(groups) * rows * tokens * self.input_bytes_per_token
        kept_shared = shared if recomputed < n else 0.0
        return edges - shared + kept_shared + (full - edges) * (n - recomputed) / n + inputs

    def _shared(self, recomputed: int, n: int, shared: float) -> float:
        """What a group's rerun brings back of `shared` (nothing where a kept layer keeps it)."""
        return shared if recomputed >= n else 0.0

    def cell_bytes(self, rows, tokens, context, first, last, layers=None):
        full = self.inner.cell_bytes(rows, tokens, context, first, last, layers)
        edges = self.inner.cell_bytes(rows, tokens, context, first, last, 0)
        shared = self.inner.cell_bytes(rows, tokens, context, False, False, 0)
        return self._kept(full, edges, shared, rows, tokens, layers)

    def microbatch_bytes(self, rows, seq_length, first, last, layers=None):
        full = self.inner.microbatch_bytes(rows, seq_length, first, last, layers)
        edges = self.inner.microbatch_bytes(rows, seq_length, first, last, 0)
        shared = self.inner.microbatch_bytes(rows, seq_length, False, False, 0)
        return self._kept(full, edges, shared, rows, seq_length, layers)

    def kv_buffer_bytes(self, rows, seq_length, layers=None):
        return self.inner.kv_buffer_bytes(rows, seq_length, layers)

    def kv_grad_bytes(self, rows, seq_length, layers=None):
        return self.inner.kv_grad_bytes(rows, seq_length, layers)

    def whole_sequence_kv_bytes(self, rows, seq_length, layers=None):
        _, n, _, recomputed = self._chunk(layers)
        kv = self.inner.whole_sequence_kv_bytes(rows, seq_length, layers)
        return kv * (n - recomputed) / n  # kept with its layers' activations, as Megatron's

    def wgrad_hold_bytes(self, rows, tokens, first, last, layers=None):
        return self.inner.wgrad_hold_bytes(rows, tokens, first, last, layers)

    def backward_rise(self, rows, tokens, context, seq_length, first, last, deferred=False,
                      layers=None, kv_grads=True):
        L, n, groups, recomputed = self._chunk(layers)
        a, g, h, out, f = self.inner.backward_terms(rows, tokens, context, seq_length, last,
                                                    deferred, L, kv_grads)
        scale = L / n  # per whole layer of the chunk
        shared = self._shared(recomputed, n, self.inner.cell_bytes(rows, tokens, context, False,
                                                                   False, 0))
        x = rows * tokens * self.input_bytes_per_token
        return backward_walk(n, groups, a * scale, x, g * scale, f, h * scale, out, shared)

    def microbatch_backward_rise(self, rows, seq_length, first, last, layers=None):
        L, n, groups, recomputed = self._chunk(layers)
        edges = self.inner.microbatch_bytes(rows, seq_length, False, False, 0)  # shared
        a = (self.inner.microbatch_bytes(rows, seq_length, False, False, L) - edges) / n
        out = self.inner.microbatch_bytes(rows, seq_length, False, last, 0) - edges
        x = rows * seq_length * self.input_bytes_per_token
        return backward_walk(n, groups, a, x, 0.0, 1.0, 0.0, out,
                             self._shared(recomputed, n, edges))

    def describe(self) -> str:
        return f"{self.inner.describe()}, with {self.recompute.text()}"


def checkpoint_input_bytes(hidden_size: int, dtype_bytes: int, sequence_split: int = 1) -> float:
    """Bytes per token of the hidden states a checkpointed group keeps (this TP rank's share
    of the tokens under sequence parallelism)."""
    return float(hidden_size) * dtype_bytes / max(1, sequence_split)


def with_recompute(memory: StageMemory, recompute: Optional[FullRecompute], hidden_size: int,
                   dtype_bytes: int, sequence_split: int = 1) -> StageMemory:
    """`memory` for a run with `recompute` (itself when there is none)."""
    if recompute is None:
        return memory
    return RecomputedMemory(memory, recompute,
                            checkpoint_input_bytes(hidden_size, dtype_bytes, sequence_split))


def memory_of(cost_model: CostModel, memory: Optional[StageMemory] = None) -> StageMemory:
    """`memory`, or the cost model's own estimate (CostModelMemory), with the cost model's full
    recomputation when it has one (LayerStackCostModel.with_recompute)."""
    if memory is not None:
        return memory
    estimate = CostModelMemory(cost_model)
    recompute = getattr(cost_model, "recompute", None)
    if recompute is None or estimate.model is None:
        return estimate
    return with_recompute(estimate, recompute, estimate.model.hidden_size,
                          int(getattr(cost_model, "dtype_bytes", 2)),
                          int(getattr(cost_model, "sequence_split", 1)))
