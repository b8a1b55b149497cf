"""Array helpers of the cost models: every cost-model method broadcasts like numpy and gives a
plain float back for plain-number arguments."""

from __future__ import annotations

from typing import Union

import numpy as np

ArrayLike = Union[int, float, np.ndarray]


def scalar_or_array(x: ArrayLike) -> Union[float, np.ndarray]:
    """Plain float for 0-d results so scalar callers get scalars back."""
    x = np.asarray(x, dtype=np.float64)
    return float(x) if x.ndim == 0 else x


def as_float_arrays(*xs: ArrayLike) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(x, dtype=np.float64) for x in xs)


def broadcast_shape(*xs: ArrayLike) -> tuple[int, ...]:
    return np.broadcast(*(np.asarray(x) for x in xs)).shape
