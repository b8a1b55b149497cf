"""ProfiledCostModel: layer times measured on a real device, fitted, saved and loaded as JSON.

Everything here is numpy; measuring lives in measure.py (it needs torch and Megatron-Core).

The fit follows the TeraPipe paper's form, per batch size and per direction (forward, backward):

    t(l, c) = t(l, 0) + [c > 0] * max(0, a0 + a1 l + a2 c + a3 l c)

t(l, 0) is the measured table of context-free slices (piecewise linear in l, made
non-decreasing); the context term is a least-squares fit weighted to minimise relative error,
because short slices take a few hundred microseconds and long ones seconds. Batch sizes between
measured ones interpolate linearly; beyond the largest, time grows in proportion to the rows.

Weight gradients (format version 3): on context-free cells the layer also ran with deferred
weight gradients; tables over the lengths give the W action's time ("wgrad") and what deferring
saved the backward ("wgrad_saving"). Older profiles estimate both from the forward and backward.

Edge costs (format version 2): the first stage's embedding and the last stage's final norm,
output layer and loss, measured per (batch, length) and fitted as a + b * tokens per part and
direction (they do not depend on the context). Version-1 profiles, and profiles measured
without a vocabulary size, have none: their edge times are zero.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, TextIO, Union

import numpy as np

from .cost_model import EDGE_PARTS, LayerStackCostModel, Link, ModelDims, _f64

FORMAT = "megatron-terapipe-layer-profile"
FORMAT_VERSION = 3  # 2 added "edges", 3 measured weight gradients ("wgrad"); older files load
READABLE_VERSIONS = (1, 2, 3)
# measured on context-free cells (version 3): the W action, and what deferring saves the backward
WGRAD_FITS = ("wgrad", "wgrad_saving")
DIRECTIONS = ("forward", "backward")
EDGE_KEYS = tuple(f"{part}_{d}" for part in EDGE_PARTS for d in DIRECTIONS)
PathLike = Union[str, Path]


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


COLUMNS = ("batch", "length", "context", "forward", "backward", "deferred_backward", "wgrad")


@dataclass(frozen=True)
class _BatchFit:
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


def _fit_one(length: np.ndarray, context: np.ndarray, seconds: np.ndarray) -> _BatchFit:
    base_mask = context == 0
    if not base_mask.any():
        raise ValueError("layer measurements need context-free cells (context 0) at every "
                         "measured batch size")
    lengths = np.unique(length[base_mask])
    base = np.array([np.median(seconds[base_mask & (length == l)]) for l in lengths])
    base = np.maximum.accumulate(base)  # longer slices never cost less (noise aside)
    fit = _BatchFit(lengths, base, np.zeros(4))
    ctx = ~base_mask
    if ctx.sum() >= 4:
        l, c = length[ctx], context[ctx]
        residual = seconds[ctx] - fit(l, np.zeros_like(c))
        A = np.stack([np.ones_like(l), l, c, l * c], axis=1)
        w = 1.0 / np.maximum(seconds[ctx], 1e-12)  # relative error
        # scale columns so the normal equations are well conditioned
        scale = np.maximum(np.abs(A).max(axis=0), 1e-30)
        coef, *_ = np.linalg.lstsq(A * w[:, None] / scale, residual * w, rcond=None)
        fit = _BatchFit(lengths, base, coef / scale)
    elif ctx.any():
        # too few points for four coefficients: a pure per-context-token slope
        l, c = length[ctx], context[ctx]
        residual = seconds[ctx] - fit(l, np.zeros_like(c))
        a3 = float(np.sum(residual * l * c) / np.sum((l * c) ** 2))
        fit = _BatchFit(lengths, base, np.array([0.0, 0.0, 0.0, a3]))
    return fit


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
        b, l = _f64(batch, length)
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


def _fit_affine(tokens: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """a, b >= 0 minimising the relative error of a + b * tokens (least squares)."""
    w = 1.0 / np.maximum(seconds, 1e-12)
    if len(np.unique(tokens)) >= 2:
        A = np.stack([np.ones_like(tokens), tokens], axis=1) * w[:, None]
        scale = np.abs(A).max(axis=0)
        (a, b), *_ = np.linalg.lstsq(A / scale, seconds * w, rcond=None)
        a, b = a / scale[0], b / scale[1]
        if a >= 0 and b >= 0:
            return float(a), float(b)
        if b < 0:  # no growth with the tokens in the data: a constant
            return float(np.sum(w * w * seconds) / np.sum(w * w)), 0.0
    # a negative intercept (or one size only): proportional to the tokens
    return 0.0, float(np.sum(w * w * seconds * tokens) / np.sum((w * tokens) ** 2))


def fit_edge_times(measurements: EdgeMeasurements) -> EdgeTimeFit:
    """Least-squares a + b * tokens per edge part and direction (relative error, a, b >= 0)."""
    m = measurements
    if len(m) == 0:
        raise ValueError("no edge measurements to fit")
    columns = [getattr(m, k) for k in EDGE_KEYS]
    if any(np.any(~np.isfinite(c)) or np.any(c < 0) for c in columns):
        raise ValueError("edge measurements contain negative or non-finite times")
    if "vocab_size" not in m.metadata:
        raise ValueError("edge measurements need metadata['vocab_size']")
    tokens = m.batch * m.length
    coef = {k: _fit_affine(tokens, getattr(m, k)) for k in EDGE_KEYS}
    return EdgeTimeFit(coef, dict(m.metadata), m)


class LayerTimeFit:
    """Fitted forward and backward seconds of one layer, for any (batch, length, context), and
    optionally of the pipeline's edges (`edges`: None when not measured)."""

    def __init__(self, fits: dict[str, dict[int, _BatchFit]], metadata: Optional[dict] = None,
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
        measure.measure_edge_times); save it to write them into the profile."""
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
        b, l, c = _f64(batch, length, context)
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
            fits: dict[str, dict[int, _BatchFit]] = {}
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
                    fits[d][int(b)] = _BatchFit(lengths, base, coef)
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


def fit_layer_times(measurements: LayerMeasurements, holdout: float = 0.2, seed: int = 0
                    ) -> LayerTimeFit:
    """Fit per batch size and direction; report relative error on held-out cells. Edge
    measurements (`measurements.edges`), if any, are fitted too (fit_edge_times).

    A random `holdout` share of the cells (never the shortest and longest context-free cell of
    a batch size, which pin the table's ends) is left out of a first fit and predicted; the
    returned fit then uses every cell.
    """
    m = measurements
    if len(m) == 0:
        raise ValueError("no layer measurements to fit")
    if np.any(~np.isfinite(m.forward)) or np.any(~np.isfinite(m.backward)) or np.any(m.forward < 0):
        raise ValueError("layer measurements contain negative or non-finite times")

    def fit(sub: LayerMeasurements) -> dict[str, dict[int, _BatchFit]]:
        out: dict[str, dict[int, _BatchFit]] = {d: {} for d in DIRECTIONS}
        for b in np.unique(sub.batch):
            sel = sub.batch == b
            for d in DIRECTIONS:
                out[d][int(b)] = _fit_one(sub.length[sel], sub.context[sel], getattr(sub, d)[sel])
        return out

    holdout_error: dict = {}
    wgrad = _wgrad_fits(m)
    if 0 < holdout < 1:
        rng = np.random.default_rng(seed)
        pinned = np.zeros(len(m), dtype=bool)
        for b in np.unique(m.batch):
            base = np.flatnonzero((m.batch == b) & (m.context == 0))
            if len(base):
                pinned[base[np.argmin(m.length[base])]] = True
                pinned[base[np.argmax(m.length[base])]] = True
        candidates = np.flatnonzero(~pinned)
        n_out = int(round(holdout * len(m)))
        if n_out and len(candidates) > n_out:
            out = rng.choice(candidates, size=n_out, replace=False)
            test = np.zeros(len(m), dtype=bool)
            test[out] = True
            trial = LayerTimeFit(fit(m.subset(~test)))
            holdout_error["cells"] = int(test.sum())
            for d in DIRECTIONS:
                pred = trial.seconds(d, m.batch[test], m.length[test], m.context[test])
                truth = getattr(m, d)[test]
                rel = np.abs(pred - truth) / np.maximum(truth, 1e-12)
                holdout_error[d] = {"mean_relative": float(rel.mean()),
                                    "max_relative": float(rel.max())}
    edges = fit_edge_times(m.edges) if m.edges is not None else None
    fits = fit(m)
    if wgrad:
        fits.update(wgrad)
    return LayerTimeFit(fits, dict(m.metadata), m, holdout_error, edges)


def _wgrad_fits(m: LayerMeasurements) -> dict[str, dict[int, _BatchFit]]:
    """Per batch size, tables over the measured lengths (no context term: the weight-gradient
    GEMMs never see the context) of the W action ("wgrad") and of what deferring saved the
    backward ("wgrad_saving": full backward less deferred backward, at least 0). Empty unless
    every batch size has context-free cells with both measured."""
    if m.wgrad is None or m.deferred_backward is None:
        return {}
    out: dict[str, dict[int, _BatchFit]] = {"wgrad": {}, "wgrad_saving": {}}
    for b in np.unique(m.batch):
        sel = ((m.batch == b) & (m.context == 0) & np.isfinite(m.wgrad)
               & np.isfinite(m.deferred_backward))
        if not sel.any():
            return {}
        if np.any(m.wgrad[sel] < 0) or np.any(m.deferred_backward[sel] < 0):
            raise ValueError("layer measurements contain negative weight-gradient times")
        saving = np.maximum(m.backward[sel] - m.deferred_backward[sel], 0.0)
        out["wgrad"][int(b)] = _fit_one(m.length[sel], m.context[sel], m.wgrad[sel])
        out["wgrad_saving"][int(b)] = _fit_one(m.length[sel], m.context[sel], saving)
    return out


class ProfiledCostModel(LayerStackCostModel):
    """Stage times from a fitted layer profile; memory and transfer from the model shape.

    Edge times (embedding on the first stage; final norm, output layer and loss on the last)
    come from the profile's edge fit, or are zero if it has none (describe() says which).
    """

    def __init__(self, fit: LayerTimeFit, layers_per_stage: int, link: Link,
                 model: Optional[ModelDims] = None, tensor_parallel: Optional[int] = None,
                 dtype_bytes: int = 2, flash_attention: bool = True):
        meta_model = fit.metadata.get("model", {})
        if model is None:
            try:
                model = ModelDims(num_layers=int(meta_model.get("num_layers", 1)),
                                  hidden_size=int(meta_model["hidden_size"]),
                                  num_attention_heads=int(meta_model["num_attention_heads"]),
                                  ffn_hidden_size=meta_model.get("ffn_hidden_size"),
                                  num_query_groups=meta_model.get("num_query_groups"),
                                  gated_linear_unit=bool(meta_model.get("gated_linear_unit", False)),
                                  vocab_size=fit.edges.vocab_size if fit.edges is not None else None,
                                  name=str(fit.metadata.get("model_name", "profiled")))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"layer profile metadata has no usable model dimensions ({exc})") from None
        fit.check_matches(model, tensor_parallel)
        tp = tensor_parallel if tensor_parallel is not None else int(fit.metadata.get("tensor_parallel", 1))
        super().__init__(model, layers_per_stage, link, tp, dtype_bytes, flash_attention)
        self.fit = fit

    @classmethod
    def load(cls, path: PathLike, layers_per_stage: int, link: Link,
             model: Optional[ModelDims] = None, tensor_parallel: Optional[int] = None,
             **kwargs) -> "ProfiledCostModel":
        return cls(LayerTimeFit.load(path, model, tensor_parallel), layers_per_stage, link,
                   model=model, tensor_parallel=tensor_parallel, **kwargs)

    def layer_forward_time(self, batch, length, context):
        return self.fit.seconds("forward", batch, length, context)

    def layer_backward_time(self, batch, length, context):
        return self.fit.seconds("backward", batch, length, context)

    def layer_wgrad_time(self, batch, length, context):
        """Measured: the W action's GEMMs for these tokens (they do not depend on the context).
        Profiles without the measurement (format version < 3) use the base class's estimate."""
        if not self.fit.has_wgrad:
            return super().layer_wgrad_time(batch, length, context)
        return self._context_free("wgrad", batch, length)

    def layer_deferred_backward_saving(self, batch, length, context):
        """Measured: the full backward less the deferred one, on context-free cells of these
        tokens. Without the measurement: the W time, as the base class."""
        if not self.fit.has_wgrad:
            return super().layer_deferred_backward_saving(batch, length, context)
        return self._context_free("wgrad_saving", batch, length)

    def _context_free(self, table: str, batch, length):
        b, l = _f64(batch, length)
        return self.fit.seconds(table, b, l, np.zeros_like(l))

    def edge_part_time(self, part, direction, batch, length):
        if self.fit.edges is None:
            return super().edge_part_time(part, direction, batch, length)
        return self.fit.edges.seconds(part, direction, batch, length)

    def describe(self) -> str:
        md = self.fit.metadata
        return (f"profiled: {md.get('device', '?')} {md.get('dtype', '?')}, "
                f"{self.layers_per_stage} layers/stage, TP={self.tensor_parallel}; "
                f"{self.fit.edges_note()}")


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


class Progress:
    """Plain-text progress on stderr: "measuring 12/40 ...", one line updated in place."""

    def __init__(self, total: int, label: str = "measuring", stream: Optional[TextIO] = None,
                 enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled

    def step(self, note: str = "") -> None:
        self.done += 1
        if self.enabled:
            width = len(str(self.total))
            self.stream.write(f"\r{self.label} {self.done:>{width}}/{self.total} {note:<40}")
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()


__all__ = ["EdgeMeasurements", "EdgeTimeFit", "LayerMeasurements", "LayerTimeFit",
           "ProfiledCostModel", "fit_edge_times", "fit_layer_times", "measure_edge_times",
           "measure_layer_times", "default_grid", "FORMAT_VERSION"]
