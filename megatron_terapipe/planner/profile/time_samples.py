"""Measured seconds a layer profile is fitted to: one layer on (batch, length, context) cells,
and the pipeline's edges (embedding; output layer and loss) on (batch, length) points.
megatron/measure/layers.py and megatron/measure/edges.py measure them; planner/profile/least_squares.py fits them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..cost.cost_model import EDGE_PARTS

DIRECTIONS = ("forward", "backward")
EDGE_KEYS = tuple(f"{part}_{d}" for part in EDGE_PARTS for d in DIRECTIONS)
COLUMNS = ("batch", "length", "context", "forward", "backward", "deferred_backward", "wgrad")


@dataclass
class LayerMeasurements:
    """Seconds of ONE layer's forward and backward on cells (batch, length, context).

    deferred_backward, wgrad (optional, NaN where not measured): on context-free cells, the
    backward with deferred weight gradients and the W action computing them (format version 3).
    """

    batch: np.ndarray
    length: np.ndarray
    context: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    metadata: dict = field(default_factory=dict)
    edges: Optional["EdgeMeasurements"] = None  # embedding / output layer, if measured
    deferred_backward: Optional[np.ndarray] = None
    wgrad: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        for name in COLUMNS:
            value = getattr(self, name)
            if value is not None:  # None entries (JSON null) read as NaN: not measured
                setattr(self, name, np.asarray(value, dtype=np.float64).ravel())
        n = len(self.batch)
        if any(getattr(self, k) is not None and len(getattr(self, k)) != n for k in COLUMNS):
            raise ValueError("layer measurements: batch, length, context, forward, backward (and "
                             "deferred_backward, wgrad) must have the same number of entries")

    def __len__(self) -> int:
        return len(self.batch)

    def subset(self, mask: np.ndarray) -> "LayerMeasurements":
        columns = {k: (getattr(self, k)[mask] if getattr(self, k) is not None else None)
                   for k in COLUMNS}
        return LayerMeasurements(**columns, metadata=dict(self.metadata), edges=self.edges)

    def to_dict(self) -> dict:
        return {k: [None if np.isnan(x) else x for x in getattr(self, k).tolist()]
                for k in COLUMNS if getattr(self, k) is not None}


@dataclass
class EdgeMeasurements:
    """Seconds of the pipeline's edges on cells of `batch` rows by `length` tokens.

    embedding_*: Megatron's LanguageModelEmbedding (first stage). output_*: the final layer
    norm, the output layer (hidden -> vocab) and the loss with its masked sum (last stage).
    metadata: vocab_size (required), position_embedding_type, and how they were measured.
    """

    batch: np.ndarray
    length: np.ndarray
    embedding_forward: np.ndarray
    embedding_backward: np.ndarray
    output_forward: np.ndarray
    output_backward: np.ndarray
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = ("batch", "length") + EDGE_KEYS
        for name in names:
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.float64).ravel())
        if any(len(getattr(self, k)) != len(self.batch) for k in names):
            raise ValueError("edge measurements: every column must have the same number of entries")

    def __len__(self) -> int:
        return len(self.batch)

    def to_dict(self) -> dict:
        return {k: getattr(self, k).tolist() for k in ("batch", "length") + EDGE_KEYS}


def default_grid(seq_length: int, batch_sizes: Sequence[int], granularity: int = 8,
                 points: int = 6) -> list[tuple[int, int, int]]:
    """(batch, length, context) cells to measure: geometric lengths, contexts up to the
    sequence length, every batch size; context-free cells at every length."""
    top = max(granularity, seq_length)
    lengths = sorted({int(min(top, granularity * round(x / granularity) or granularity))
                      for x in np.geomspace(granularity, top, points)})
    contexts = sorted({0} | {int(granularity * round(x / granularity))
                             for x in np.linspace(0, top, points)[1:]})
    cells = []
    for b in batch_sizes:
        for l in lengths:
            for c in contexts:
                if l + c <= top:
                    cells.append((int(b), l, c))
    return cells
