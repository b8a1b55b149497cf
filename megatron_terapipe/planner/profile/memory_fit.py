"""FittedMemory: a StageMemory fitted to bytes measured on the device
(megatron/measure/memory.py counts what autograd saves, with the same meter as the tests).

The measurement runs cells through stage models of one and two layers, with and without the
embedding or the output layer and loss, so that each part separates: per layer, shared by the
cell's layers (the causal mask of a slice with context, RoPE's angles), the embedding, the
output layer and loss. Each part is linear in a few products of the cell's rows r, tokens t
and context c (`cell_features`, `hold_features`, `whole_features`); with the counts exact, least squares recovers the bytes
exactly, and `max_fit_error` says how close it came. K/V buffers are 2 x kv width x dtype
bytes per row, token and layer, measured too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from ..cost.dims import ModelDims
from ..cost.stage_memory import StageMemory

FORMAT_VERSION = 1
PARTS = ("layer", "shared", "embedding", "output")  # cell_bytes = L layer + shared + edges

Features = Callable[[float, float, float], list[float]]


def cell_features(r: float, t: float, c: float) -> list[float]:
    """r t (hidden-sized tensors), r c (prefix copies: grouped-query K/V), t (per-token tables
    such as RoPE's), t (t + c) for a slice with context (its causal mask), 1."""
    return [r * t, r * c, t, t * (t + c) if c > 0 else 0.0, 1.0]


def hold_features(r: float, t: float, c: float = 0.0) -> list[float]:
    return [r * t, 1.0]


def whole_features(r: float, t: float, c: float = 0.0) -> list[float]:
    """Megatron's attention over a whole sequence may keep its t x t scores."""
    return [r * t, r * t * t, t, 1.0]


@dataclass
class MemoryMeasurements:
    """Bytes measured per stage kind: "layers1", "layers2" (middle stages of one and two
    layers), "first1" (embedding + one layer), "last1" (one layer + output layer and loss).

    cells[kind]: (rows, tokens, context, activation bytes of that slice, K/V buffers excluded);
    holds[kind]: (rows, tokens, bytes left for the W action by a deferred backward);
    wholes[kind]: (rows, tokens, bytes of a whole microbatch without TeraPipe cells);
    kv_bytes_per_token: K/V buffer bytes per row, token and layer;
    freed_before_kv_grad(_deferred): the share of a layer's cell activations its backward frees
    before it allocates the K/V gradient buffers, less what it keeps for the W action when
    deferring (StageMemory.kv_grad_rise; the least measured)."""

    cells: dict[str, list[tuple[int, int, int, float]]]
    holds: dict[str, list[tuple[int, int, float]]]
    wholes: dict[str, list[tuple[int, int, float]]]
    kv_bytes_per_token: float
    freed_before_kv_grad: float = 0.0
    freed_before_kv_grad_deferred: float = 0.0
    metadata: dict = field(default_factory=dict)


def _parts(rows: dict[str, dict[tuple, float]]) -> dict[str, dict[tuple, float]]:
    """Per point, the four parts from the four stage kinds' bytes."""
    one, two = rows["layers1"], rows["layers2"]
    out: dict[str, dict[tuple, float]] = {p: {} for p in PARTS}
    for point in one:
        out["layer"][point] = two[point] - one[point]
        out["shared"][point] = 2 * one[point] - two[point]
        out["embedding"][point] = rows["first1"][point] - one[point]
        out["output"][point] = rows["last1"][point] - one[point]
    return out


def _fit(points: dict[tuple, float], features: Features) -> list[float]:
    keys = sorted(points)
    X = np.array([features(*k) for k in keys], dtype=np.float64)
    y = np.array([points[k] for k in keys], dtype=np.float64)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    return [float(v) for v in coef]


def _table(entries: dict[str, list[tuple]]) -> dict[str, dict[tuple, float]]:
    return {kind: {tuple(e[:-1]): float(e[-1]) for e in rows} for kind, rows in entries.items()}


@dataclass
class FittedMemory(StageMemory):
    """Bytes per part (PARTS) as coefficients of the feature functions, for a stage of
    `layers_per_stage` layers."""

    cell: dict[str, list[float]]
    hold: dict[str, list[float]]
    whole: dict[str, list[float]]
    kv_bytes_per_token: float
    layers_per_stage: int = 1
    metadata: dict = field(default_factory=dict)
    max_fit_error: float = 0.0  # largest relative error on the measured cells
    freed_before_kv_grad: float = 0.0
    freed_before_kv_grad_deferred: float = 0.0

    @classmethod
    def fit(cls, m: MemoryMeasurements, layers_per_stage: int = 1) -> "FittedMemory":
        kinds = ("layers1", "layers2", "first1", "last1")
        for name, table in (("cells", m.cells), ("holds", m.holds), ("wholes", m.wholes)):
            missing = [k for k in kinds if k not in table]
            if missing:
                raise ValueError(f"memory measurements lack {name} of {', '.join(missing)}")
        fitted = cls({p: _fit(v, cell_features) for p, v in _parts(_table(m.cells)).items()},
                     {p: _fit(v, hold_features) for p, v in _parts(_table(m.holds)).items()},
                     {p: _fit(v, whole_features) for p, v in _parts(_table(m.wholes)).items()},
                     float(m.kv_bytes_per_token), layers_per_stage, dict(m.metadata),
                     freed_before_kv_grad=float(m.freed_before_kv_grad),
                     freed_before_kv_grad_deferred=float(m.freed_before_kv_grad_deferred))
        fitted.max_fit_error = fitted.error_on(m)
        return fitted

    def error_on(self, m: MemoryMeasurements) -> float:
        """Largest relative error of the fit on measured cells (every stage kind)."""
        shape = {"layers1": (1, False, False), "layers2": (2, False, False),
                 "first1": (1, True, False), "last1": (1, False, True)}
        worst = 0.0
        for kind, (layers, first, last) in shape.items():
            for r, t, c, measured in m.cells[kind]:
                predicted = self.cell_bytes(r, t, c, first, last, layers)
                worst = max(worst, abs(predicted - measured) / max(measured, 1.0))
        return worst

    def _sum(self, table: dict[str, list[float]], features: Features, r, t, c, first, last,
             layers) -> float:
        f = np.array(features(float(r), float(t), float(c)))
        L = self.layers_per_stage if layers is None else float(layers)
        total = L * float(f @ table["layer"]) + float(f @ table["shared"])
        if first:
            total += float(f @ table["embedding"])
        if last:
            total += float(f @ table["output"])
        return max(total, 0.0)

    def cell_bytes(self, rows, tokens, context, first, last, layers=None):
        return self._sum(self.cell, cell_features, rows, tokens, context, first, last, layers)

    def kv_buffer_bytes(self, rows, seq_length, layers=None):
        L = self.layers_per_stage if layers is None else float(layers)
        return L * rows * seq_length * self.kv_bytes_per_token

    def wgrad_hold_bytes(self, rows, tokens, first, last, layers=None):
        return self._sum(self.hold, hold_features, rows, tokens, 0, first, last, layers)

    def microbatch_bytes(self, rows, seq_length, first, last, layers=None):
        return self._sum(self.whole, whole_features, rows, seq_length, 0, first, last, layers)

    def describe(self) -> str:
        md = self.metadata
        return (f"measured: {md.get('device', '?')} {md.get('dtype', '?')}, "
                f"{self.layers_per_stage} layers/stage (fit within {100 * self.max_fit_error:.1f}%)")

    # ---- files --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": "megatron_terapipe memory profile", "format_version": FORMAT_VERSION,
                "cell": self.cell, "hold": self.hold, "whole": self.whole,
                "kv_bytes_per_token": self.kv_bytes_per_token, "metadata": self.metadata,
                "max_fit_error": self.max_fit_error,
                "freed_before_kv_grad": self.freed_before_kv_grad,
                "freed_before_kv_grad_deferred": self.freed_before_kv_grad_deferred}

    def save(self, path: Union[str, Path]) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: Union[str, Path], layers_per_stage: int = 1,
             model: Optional[ModelDims] = None) -> "FittedMemory":
        """Read a memory profile; with `model`, check it was measured for that layer shape.
        Raises ValueError naming the file and the problem."""
        try:
            data = json.loads(Path(path).read_text())
            if data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('format_version')}, expected "
                                 f"{FORMAT_VERSION}: measure it again")
            fitted = cls({p: list(data["cell"][p]) for p in PARTS},
                         {p: list(data["hold"][p]) for p in PARTS},
                         {p: list(data["whole"][p]) for p in PARTS},
                         float(data["kv_bytes_per_token"]), int(layers_per_stage),
                         dict(data.get("metadata", {})), float(data.get("max_fit_error", 0.0)),
                         float(data["freed_before_kv_grad"]),
                         float(data["freed_before_kv_grad_deferred"]))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"memory profile {path}: unreadable ({type(exc).__name__}: {exc})") from None
        except ValueError as exc:
            raise ValueError(f"memory profile {path}: {exc}") from None
        if model is not None:
            fitted.check_matches(model, path)
        return fitted

    def check_parallelism(self, tensor_parallel: int, sequence_parallel: bool,
                          where: object = "memory profile") -> None:
        """ValueError unless the profile's bytes are this run's per rank: measured at the same
        TP size (older profiles without the key: 1), and, at TP > 1, with sequence parallelism
        exactly when the run uses it (it splits a rank's activations along the sequence)."""
        measured_tp = int(self.metadata.get("tensor_parallel", 1))
        if measured_tp != int(tensor_parallel):
            raise ValueError(f"{where} was measured at tensor-parallel size {measured_tp}, but the "
                             f"run has {tensor_parallel}: its bytes per rank differ; leave the "
                             "memory profile out (the cost model's estimate) or measure at this TP size")
        measured_sp = bool(self.metadata.get("sequence_parallel"))
        if tensor_parallel > 1 and measured_sp != bool(sequence_parallel):
            how, run = ("with", "does not use") if measured_sp else ("without", "uses")
            raise ValueError(f"{where} was measured {how} sequence parallelism, which the run "
                             f"{run}: leave the memory profile out (the cost model's estimate)")

    def check_matches(self, model: ModelDims, where: object = "memory profile") -> None:
        measured = self.metadata.get("model", {})
        mine = model.to_dict()
        for key in ("hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
                    "vocab_size"):
            if key in measured and key in mine and measured[key] != mine[key]:
                raise ValueError(f"{where} was measured for {key}={measured[key]}, but the model "
                                 f"has {key}={mine[key]}: measure it for this model")
