"""Megatron's full activation recomputation, as the planner prices its time.

`--recompute-granularity full` checkpoints groups of transformer layers in every model chunk
(a TransformerBlock: a stage's layers, or one virtual stage's) and reruns their forward in the
backward: `--recompute-method uniform` every layer (groups of `--recompute-num-layers`), `block`
the first `--recompute-num-layers` layers of the chunk. A TeraPipe cell runs the chunk's block,
so each backward cell reruns its own forward on those layers. What that saves in memory:
recompute_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("uniform", "block")


@dataclass(frozen=True)
class FullRecompute:
    """`--recompute-granularity full --recompute-method {method} --recompute-num-layers {num_layers}`."""

    method: str
    num_layers: int

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--recompute-method must be one of {', '.join(METHODS)} with "
                             f"--recompute-granularity full, got {self.method!r}")
        if int(self.num_layers) < (1 if self.method == "uniform" else 0):
            raise ValueError(f"--recompute-num-layers {self.num_layers} is out of range for "
                             f"--recompute-method {self.method}")

    def fraction(self, chunk_layers: int) -> float:
        """The share of a chunk's `chunk_layers` layers whose forward a backward reruns."""
        if chunk_layers <= 0:
            return 0.0
        if self.method == "uniform":
            return 1.0
        return min(int(self.num_layers), chunk_layers) / chunk_layers

    def groups(self, chunk_layers: int) -> tuple[tuple[int, int], ...]:
        """The checkpointed groups of a chunk of `chunk_layers` layers, as (first, end) layer
        indices (TransformerBlock._checkpointed_forward): uniform, consecutive groups of
        `num_layers` from layer 0 (the last one cut at the chunk's end); block, each of the
        first `num_layers` layers alone."""
        if self.method == "uniform":
            n = int(self.num_layers)
            return tuple((i, min(i + n, chunk_layers)) for i in range(0, chunk_layers, n))
        return tuple((i, i + 1) for i in range(min(int(self.num_layers), chunk_layers)))

    def text(self) -> str:
        return f"full recompute ({self.method}, {self.num_layers} layer{'s' if self.num_layers != 1 else ''})"
