"""Fitted layer and edge times, and the layer-profile JSON format they are saved in.

One direction at one batch size follows the TeraPipe paper's form (SliceTimeFit):

    t(l, c) = t(l, 0) + [c > 0] * max(0, a0 + a1 l + a2 c + a3 l c)

t(l, 0) is the measured table of context-free slices (piecewise linear in l, made
non-decreasing). Batch sizes between measured ones interpolate linearly; beyond the largest,
time grows in proportion to the rows (LayerTimeFit.seconds). Edges are a + b * tokens per part
and direction (EdgeTimeFit). planner/profile/least_squares.py makes these fits from measurements.

Format versions: 2 added the edges, 3 the measured weight gradients ("wgrad": the W action;
"wgrad_saving": what deferring saved the backward); older files still load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..cost.arrays import as_float_arrays
from ..cost.dims import ModelDims
from .time_samples import DIRECTIONS, EDGE_KEYS, EdgeMeasurements, LayerMeasurements

FORMAT = "megatron-terapipe-layer-profile"
FORMAT_VERSION = 3  # 2 added "edges", 3 measured weight gradients ("wgrad"); older files load
READABLE_VERSIONS = (1, 2, 3)
# measured on context-free cells (version 3): the W action, and what deferring saves the backward
WGRAD_FITS = ("wgrad", "wgrad_saving")
PathLike = Union[str, Path]


@dataclass(frozen=True)
class SliceTimeFit:
    """One direction at one batch size."""

    lengths: np.ndarray  # measured context-free lengths, increasing
    base: np.ndarray  # seconds at those lengths, non-decreasing
    coef: np.ndarray  # a0, a1, a2, a3 of the context term

    def __call__(self, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        L, T = self.lengths, self.base
        if len(L) == 1:
            base = np.full(np.shape(length), T[0]) * (np.asarray(length) / L[0]).clip(min=1.0)
        else:
            base = np.interp(length, L, T)
            slope = (T[-1] - T[-2]) / (L[-1] - L[-2])
            base = np.where(length > L[-1], T[-1] + slope * (length - L[-1]), base)
        a0, a1, a2, a3 = self.coef
        extra = np.maximum(0.0, a0 + a1 * length + a2 * context + a3 * length * context)
        return base + np.where(context > 0, extra, 0.0)

    def to_dict(self) -> dict:
        return {"lengths": self.lengths.tolist(), "base": self.base.tolist(), "coef": self.coef.tolist()}


class EdgeTimeFit:
    """Seconds of each edge part and direction as a + b * tokens (tokens = batch x length)."""

    def __init__(self, coef: dict[str, tuple[float, float]], metadata: Optional[dict] = None,
                 measurements: Optional[EdgeMeasurements] = None):
        missing = [k for k in EDGE_KEYS if k not in coef]
        if missing:
            raise ValueError(f"edge fit lacks {', '.join(missing)}")
        self.coef = {k: (float(coef[k][0]), float(coef[k][1])) for k in EDGE_KEYS}
        for k, (a, b) in self.coef.items():
            if not (np.isfinite(a) and np.isfinite(b)) or a < 0 or b < 0:
                raise ValueError(f"edge fit {k} has negative or non-finite coefficients ({a}, {b})")
        self.metadata = dict(metadata or {})
        self.measurements = measurements
        if "vocab_size" not in self.metadata:
            raise ValueError("edge fit metadata lacks vocab_size")

    @property
    def vocab_size(self) -> int:
        return int(self.metadata["vocab_size"])

    def seconds(self, part: str, direction: str, batch, length) -> np.ndarray:
        b, l = as_float_arrays(batch, length)
        a, slope = self.coef[f"{part}_{direction}"]
        return a + slope * b * l

    def to_dict(self) -> dict:
        return {"metadata": self.metadata,
                "fit": {k: list(v) for k, v in self.coef.items()},
                "measurements": self.measurements.to_dict() if self.measurements is not None else None}

    @classmethod
    def from_dict(cls, data) -> "EdgeTimeFit":
        try:
            coef = {k: tuple(data["fit"][k]) for k in EDGE_KEYS}
            if any(len(v) != 2 for v in coef.values()):
                raise ValueError("edge fit coefficients must be pairs (a, b)")
            metadata = data["metadata"]
            raw = data.get("measurements")
            measurements = EdgeMeasurements(**raw, metadata=metadata) if raw else None
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"missing or malformed edge field ({exc!r})") from None
        return cls(coef, metadata, measurements)

    def describe(self) -> str:
        md = self.metadata
        return (f"edges measured (vocab {self.vocab_size}, "
                f"{md.get('position_embedding_type', '?')} positions)")


class LayerTimeFit:
    """Fitted forward and backward seconds of one layer, for any (batch, length, context), and
    optionally of the pipeline's edges (`edges`: None when not measured)."""

    def __init__(self, fits: dict[str, dict[int, SliceTimeFit]], metadata: Optional[dict] = None,
                 measurements: Optional[LayerMeasurements] = None,
                 holdout_error: Optional[dict] = None, edges: Optional[EdgeTimeFit] = None,
                 format_version: int = FORMAT_VERSION):
        self.fits = fits
        self.metadata = dict(metadata or {})
        self.measurements = measurements
        self.holdout_error = holdout_error or {}
        self.edges = edges
        self.format_version = format_version  # of the file it was loaded from
        self.batch_sizes = np.array(sorted(fits["forward"]), dtype=np.float64)

    def with_edges(self, edges: Optional[EdgeTimeFit]) -> "LayerTimeFit":
        """The same layer fit with these edge costs (e.g. measured separately, see
        megatron/measure/edges.py); save it to write them into the profile."""
        return LayerTimeFit(self.fits, self.metadata, self.measurements, self.holdout_error, edges)

    def edges_note(self) -> str:
        """How the profile accounts for the embedding / output layer / loss."""
        if self.edges is not None:
            return self.edges.describe()
        if self.format_version < 2:
            return (f"no edge costs (format version {self.format_version} profile): embedding, "
                    "output layer and loss count as 0")
        return "no edge costs (measured without a vocab size): embedding, output layer and loss count as 0"

    # ---- evaluation -------------------------------------------------------------------------
    def seconds(self, direction: str, batch, length, context) -> np.ndarray:
        b, l, c = as_float_arrays(batch, length, context)
        b, l, c = np.broadcast_arrays(b, l, c)
        grid = self.batch_sizes
        per_grid = np.stack([self.fits[direction][int(g)](l, c) for g in grid])  # [G, ...]
        if len(grid) == 1:
            return per_grid[0] * np.maximum(b / grid[0], 1.0)
        idx = np.clip(np.searchsorted(grid, b, side="right") - 1, 0, len(grid) - 2)
        lo, hi = grid[idx], grid[idx + 1]
        t_lo = np.take_along_axis(per_grid, idx[None], 0)[0]
        t_hi = np.take_along_axis(per_grid, (idx + 1)[None], 0)[0]
        w = np.clip((b - lo) / (hi - lo), 0.0, 1.0)
        inside = t_lo + w * (t_hi - t_lo)
        beyond = t_hi * b / grid[-1]  # more rows than measured: time grows with the rows
        return np.where(b > grid[-1], beyond, inside)

    # ---- persistence --------------------------------------------------------------------------
    @property
    def is_current_format(self) -> bool:
        """Whether it was written in this version's format (older ones lack newer measurements,
        e.g. the W action's time: caches measure them again)."""
        return self.format_version == FORMAT_VERSION

    @property
    def has_wgrad(self) -> bool:
        """Whether the W action and what deferring saves were measured (format version 3;
        `fit_layer_times` and `load` keep both tables or neither)."""
        return all(k in self.fits for k in WGRAD_FITS)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "metadata": self.metadata,
            "measurements": self.measurements.to_dict() if self.measurements is not None else None,
            "fit": {d: {str(b): f.to_dict() for b, f in sorted(fits.items())}
                    for d, fits in self.fits.items()},
            "holdout_error": self.holdout_error,
            "edges": self.edges.to_dict() if self.edges is not None else None,
        }

    def save(self, path: PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: PathLike, model: Optional[ModelDims] = None,
             tensor_parallel: Optional[int] = None) -> "LayerTimeFit":
        """Read a profile; ValueError naming the file if it is malformed or does not match
        `model` / `tensor_parallel` (when given)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read layer profile {path}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"layer profile {path} is not valid JSON (truncated or corrupt?): "
                             f"{exc.msg} at line {exc.lineno}") from None
        try:
            fit = cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"layer profile {path}: {exc}") from None
        fit.check_matches(model, tensor_parallel, source=str(path))
        return fit

    @classmethod
    def from_dict(cls, data) -> "LayerTimeFit":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a megatron-terapipe layer profile (expected format {FORMAT!r})")
        version = data.get("format_version")
        if version not in READABLE_VERSIONS:
            raise ValueError(f"format version {version!r} is not supported (this version reads "
                             f"{', '.join(map(str, READABLE_VERSIONS))}); measure the profile again")
        try:
            fits: dict[str, dict[int, SliceTimeFit]] = {}
            measured = DIRECTIONS + (tuple(k for k in WGRAD_FITS if k in data["fit"])
                                     if version >= 3 else ())
            for d in measured:
                fits[d] = {}
                for b, entry in data["fit"][d].items():
                    lengths = np.asarray(entry["lengths"], dtype=np.float64)
                    base = np.asarray(entry["base"], dtype=np.float64)
                    coef = np.asarray(entry["coef"], dtype=np.float64)
                    if (lengths.ndim != 1 or len(lengths) == 0 or lengths.shape != base.shape
                            or coef.shape != (4,)):
                        raise ValueError(f"fit for {d} at batch {b} has inconsistent shapes")
                    if not (np.all(np.isfinite(lengths)) and np.all(np.isfinite(base))
                            and np.all(np.isfinite(coef))):
                        raise ValueError(f"fit for {d} at batch {b} has non-finite numbers")
                    if np.any(np.diff(lengths) <= 0) or np.any(base < 0) or lengths[0] <= 0:
                        raise ValueError(f"fit for {d} at batch {b} has unsorted lengths or "
                                         "negative times")
                    fits[d][int(b)] = SliceTimeFit(lengths, base, coef)
            if not fits["forward"] or any(set(f) != set(fits["forward"]) for f in fits.values()):
                raise ValueError("forward, backward (and wgrad) fits must cover the same batch sizes")
            metadata = data["metadata"]
            if not isinstance(metadata, dict) or "model" not in metadata:
                raise ValueError("metadata with the model dimensions is missing")
            raw = data.get("measurements")
            measurements = LayerMeasurements(**raw, metadata=metadata) if raw else None
            raw_edges = data.get("edges") if version >= 2 else None
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"missing or malformed field ({exc!r})") from None
        edges = EdgeTimeFit.from_dict(raw_edges) if raw_edges else None
        if measurements is not None:
            measurements.edges = edges.measurements if edges is not None else None
        return cls(fits, metadata, measurements, data.get("holdout_error") or {}, edges,
                   format_version=int(version))

    def check_matches(self, model: Optional[ModelDims], tensor_parallel: Optional[int],
                      source: str = "layer profile") -> None:
        if model is not None:
            measured = self.metadata.get("model", {})
            wanted = model.to_dict()
            diffs = [f"{k} {measured.get(k)!r} in the profile vs {v!r} requested"
                     for k, v in wanted.items()
                     if k not in ("num_layers", "vocab_size") and measured.get(k) != v]
            if diffs:
                raise ValueError(f"layer profile {source} was measured for another model: "
                                 + "; ".join(diffs) + ". Measure a profile for this model.")
            if (self.edges is not None and model.vocab_size is not None
                    and self.edges.vocab_size != model.vocab_size):
                raise ValueError(f"layer profile {source} measured its embedding and output layer "
                                 f"with vocab size {self.edges.vocab_size}, not {model.vocab_size}: "
                                 "measure the edges for this vocabulary")
        if tensor_parallel is not None:
            tp = self.metadata.get("tensor_parallel", 1)
            if tp != tensor_parallel:
                raise ValueError(f"layer profile {source} was measured with tensor-parallel size "
                                 f"{tp}, not {tensor_parallel}")
