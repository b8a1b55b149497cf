"""ProfiledCostModel: layer times measured on a real device, fitted, saved and loaded as JSON.

Everything here is numpy; measuring lives in measure.py (it needs torch and Megatron-Core).

The fit follows the TeraPipe paper's form, per batch size and per direction (forward, backward):

    t(l, c) = t(l, 0) + [c > 0] * max(0, a0 + a1 l + a2 c + a3 l c)

t(l, 0) is the measured table of context-free slices (piecewise linear in l, made
non-decreasing); the context term is a least-squares fit weighted to minimise relative error,
because short slices take a few hundred microseconds and long ones seconds. Batch sizes between
measured ones interpolate linearly; beyond the largest, time grows in proportion to the rows.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, TextIO, Union

import numpy as np

from .cost_model import LayerStackCostModel, Link, ModelDims, _f64

FORMAT = "megatron-terapipe-layer-profile"
FORMAT_VERSION = 1
DIRECTIONS = ("forward", "backward")
PathLike = Union[str, Path]


@dataclass
class LayerMeasurements:
    """Seconds of ONE layer's forward and backward on cells (batch, length, context)."""

    batch: np.ndarray
    length: np.ndarray
    context: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("batch", "length", "context", "forward", "backward"):
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.float64).ravel())
        n = len(self.batch)
        if any(len(getattr(self, k)) != n for k in ("length", "context", "forward", "backward")):
            raise ValueError("layer measurements: batch, length, context, forward and backward "
                             "must have the same number of entries")

    def __len__(self) -> int:
        return len(self.batch)

    def subset(self, mask: np.ndarray) -> "LayerMeasurements":
        return LayerMeasurements(self.batch[mask], self.length[mask], self.context[mask],
                                 self.forward[mask], self.backward[mask], dict(self.metadata))

    def to_dict(self) -> dict:
        return {k: getattr(self, k).tolist() for k in ("batch", "length", "context", "forward", "backward")}


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


class LayerTimeFit:
    """Fitted forward and backward seconds of one layer, for any (batch, length, context)."""

    def __init__(self, fits: dict[str, dict[int, _BatchFit]], metadata: Optional[dict] = None,
                 measurements: Optional[LayerMeasurements] = None,
                 holdout_error: Optional[dict] = None):
        self.fits = fits
        self.metadata = dict(metadata or {})
        self.measurements = measurements
        self.holdout_error = holdout_error or {}
        self.batch_sizes = np.array(sorted(fits["forward"]), dtype=np.float64)

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
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "metadata": self.metadata,
            "measurements": self.measurements.to_dict() if self.measurements is not None else None,
            "fit": {d: {str(b): f.to_dict() for b, f in sorted(self.fits[d].items())} for d in DIRECTIONS},
            "holdout_error": self.holdout_error,
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
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format version {data.get('format_version')!r} is not supported "
                             f"(this version reads {FORMAT_VERSION}); measure the profile again")
        try:
            fits: dict[str, dict[int, _BatchFit]] = {}
            for d in DIRECTIONS:
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
            if not fits["forward"] or set(fits["forward"]) != set(fits["backward"]):
                raise ValueError("forward and backward fits must cover the same batch sizes")
            metadata = data["metadata"]
            if not isinstance(metadata, dict) or "model" not in metadata:
                raise ValueError("metadata with the model dimensions is missing")
            raw = data.get("measurements")
            measurements = LayerMeasurements(**raw, metadata=metadata) if raw else None
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"missing or malformed field ({exc!r})") from None
        return cls(fits, metadata, measurements, data.get("holdout_error") or {})

    def check_matches(self, model: Optional[ModelDims], tensor_parallel: Optional[int],
                      source: str = "layer profile") -> None:
        if model is not None:
            measured = self.metadata.get("model", {})
            wanted = model.to_dict()
            diffs = [f"{k} {measured.get(k)!r} in the profile vs {v!r} requested"
                     for k, v in wanted.items() if k != "num_layers" and measured.get(k) != v]
            if diffs:
                raise ValueError(f"layer profile {source} was measured for another model: "
                                 + "; ".join(diffs) + ". Measure a profile for this model.")
        if tensor_parallel is not None:
            tp = self.metadata.get("tensor_parallel", 1)
            if tp != tensor_parallel:
                raise ValueError(f"layer profile {source} was measured with tensor-parallel size "
                                 f"{tp}, not {tensor_parallel}")


def fit_layer_times(measurements: LayerMeasurements, holdout: float = 0.2, seed: int = 0
                    ) -> LayerTimeFit:
    """Fit per batch size and direction; report relative error on held-out cells.

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
    return LayerTimeFit(fit(m), dict(m.metadata), m, holdout_error)


class ProfiledCostModel(LayerStackCostModel):
    """Stage times from a fitted layer profile; memory and transfer from the model shape."""

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

    def describe(self) -> str:
        md = self.fit.metadata
        return (f"profiled: {md.get('device', '?')} {md.get('dtype', '?')}, "
                f"{self.layers_per_stage} layers/stage, TP={self.tensor_parallel}")


def measure_layer_times(*args, **kwargs) -> LayerMeasurements:
    """Measure one Megatron layer on this device (see measure.py; imports torch lazily)."""
    from .measure import measure_layer_times as _measure

    return _measure(*args, **kwargs)


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


__all__ = ["LayerMeasurements", "LayerTimeFit", "ProfiledCostModel", "fit_layer_times",
           "measure_layer_times", "default_grid", "FORMAT_VERSION"]
