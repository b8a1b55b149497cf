"""Fitting layer profiles: least squares from measurements to SliceTimeFit, LayerTimeFit and
EdgeTimeFit (planner/profile/time_fit.py). Weighted to minimise relative error, because short slices take a few
hundred microseconds and long ones seconds."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .time_fit import EdgeTimeFit, LayerTimeFit, SliceTimeFit
from .time_samples import DIRECTIONS, EDGE_KEYS, EdgeMeasurements, LayerMeasurements


def non_decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest `values` in weighted least squares (isotonic
    regression, pool-adjacent-violators): a run that decreases becomes its weighted mean.
    A running maximum would lift every length after one high measurement to it: on GPU
    profiles whose short cells are bound by host noise (an H100's: 1.3-1.9 ms from 8 to 672
    tokens) that overpredicts them by up to 40%."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(values.astype(float), weights.astype(float)):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean2, weight2, count2 = blocks.pop()
            mean1, weight1, count1 = blocks.pop()
            total = weight1 + weight2
            blocks.append([(mean1 * weight1 + mean2 * weight2) / total, total, count1 + count2])
    return np.concatenate([np.full(int(count), mean) for mean, _, count in blocks])


def fit_slice_times(length: np.ndarray, context: np.ndarray, seconds: np.ndarray) -> SliceTimeFit:
    """One direction at one batch size: the median of the context-free cells per length (made
    non-decreasing), then the paper's context term fitted to what the table leaves over."""
    base_mask = context == 0
    if not base_mask.any():
        raise ValueError("layer measurements need context-free cells (context 0) at every "
                         "measured batch size")
    lengths = np.unique(length[base_mask])
    base = np.array([np.median(seconds[base_mask & (length == l)]) for l in lengths])
    cells = np.array([np.sum(base_mask & (length == l)) for l in lengths])
    base = non_decreasing(base, cells)  # longer slices never cost less (noise aside)
    fit = SliceTimeFit(lengths, base, np.zeros(4))
    ctx = ~base_mask
    if ctx.sum() >= 4:
        l, c = length[ctx], context[ctx]
        residual = seconds[ctx] - fit(l, np.zeros_like(c))
        A = np.stack([np.ones_like(l), l, c, l * c], axis=1)
        w = 1.0 / np.maximum(seconds[ctx], 1e-12)  # relative error
        # scale columns so the normal equations are well conditioned
        scale = np.maximum(np.abs(A).max(axis=0), 1e-30)
        coef, *_ = np.linalg.lstsq(A * w[:, None] / scale, residual * w, rcond=None)
        fit = SliceTimeFit(lengths, base, coef / scale)
    elif ctx.any():
        # too few points for four coefficients: a pure per-context-token slope
        l, c = length[ctx], context[ctx]
        residual = seconds[ctx] - fit(l, np.zeros_like(c))
        a3 = float(np.sum(residual * l * c) / np.sum((l * c) ** 2))
        fit = SliceTimeFit(lengths, base, np.array([0.0, 0.0, 0.0, a3]))
    return fit


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
    wgrad = _wgrad_fits(m)
    held_out = _held_out_cells(m, holdout, seed)
    holdout_error = _holdout_error(m, held_out) if held_out is not None else {}
    edges = fit_edge_times(m.edges) if m.edges is not None else None
    fits = _direction_fits(m)
    if wgrad:
        fits.update(wgrad)
    return LayerTimeFit(fits, dict(m.metadata), m, holdout_error, edges)


def _direction_fits(m: LayerMeasurements) -> dict[str, dict[int, SliceTimeFit]]:
    """Forward and backward fits at every measured batch size."""
    out: dict[str, dict[int, SliceTimeFit]] = {d: {} for d in DIRECTIONS}
    for b in np.unique(m.batch):
        sel = m.batch == b
        for d in DIRECTIONS:
            out[d][int(b)] = fit_slice_times(m.length[sel], m.context[sel], getattr(m, d)[sel])
    return out


def _held_out_cells(m: LayerMeasurements, holdout: float, seed: int) -> Optional[np.ndarray]:
    """Mask of the cells left out of the trial fit (None: too few cells, or no holdout). The
    shortest and longest context-free cell of every batch size stay in: they pin the table."""
    if not 0 < holdout < 1:
        return None
    rng = np.random.default_rng(seed)
    pinned = np.zeros(len(m), dtype=bool)
    for b in np.unique(m.batch):
        base = np.flatnonzero((m.batch == b) & (m.context == 0))
        if len(base):
            pinned[base[np.argmin(m.length[base])]] = True
            pinned[base[np.argmax(m.length[base])]] = True
    candidates = np.flatnonzero(~pinned)
    n_out = int(round(holdout * len(m)))
    if not n_out or len(candidates) <= n_out:
        return None
    test = np.zeros(len(m), dtype=bool)
    test[rng.choice(candidates, size=n_out, replace=False)] = True
    return test


def _holdout_error(m: LayerMeasurements, test: np.ndarray) -> dict:
    """Relative error, per direction, of a fit without the `test` cells on those cells."""
    trial = LayerTimeFit(_direction_fits(m.subset(~test)))
    error: dict = {"cells": int(test.sum())}
    for d in DIRECTIONS:
        pred = trial.seconds(d, m.batch[test], m.length[test], m.context[test])
        truth = getattr(m, d)[test]
        rel = np.abs(pred - truth) / np.maximum(truth, 1e-12)
        error[d] = {"mean_relative": float(rel.mean()), "max_relative": float(rel.max())}
    return error


def _wgrad_fits(m: LayerMeasurements) -> dict[str, dict[int, SliceTimeFit]]:
    """Per batch size, tables over the measured lengths (no context term: the weight-gradient
    GEMMs never see the context) of the W action ("wgrad") and of what deferring saved the
    backward ("wgrad_saving": full backward less deferred backward, at least 0). Empty unless
    every batch size has context-free cells with both measured."""
    if m.wgrad is None or m.deferred_backward is None:
        return {}
    out: dict[str, dict[int, SliceTimeFit]] = {"wgrad": {}, "wgrad_saving": {}}
    for b in np.unique(m.batch):
        sel = ((m.batch == b) & (m.context == 0) & np.isfinite(m.wgrad)
               & np.isfinite(m.deferred_backward))
        if not sel.any():
            return {}
        if np.any(m.wgrad[sel] < 0) or np.any(m.deferred_backward[sel] < 0):
            raise ValueError("layer measurements contain negative weight-gradient times")
        saving = np.maximum(m.backward[sel] - m.deferred_backward[sel], 0.0)
        out["wgrad"][int(b)] = fit_slice_times(m.length[sel], m.context[sel], m.wgrad[sel])
        out["wgrad_saving"][int(b)] = fit_slice_times(m.length[sel], m.context[sel], saving)
    return out
