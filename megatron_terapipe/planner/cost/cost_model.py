"""Cost models: how long one pipeline stage takes on one cell, and what it keeps in memory.

A cell is `batch` rows by `length` new tokens, with `context` earlier tokens of the same rows
whose keys and values it attends to. Every method is vectorised: arguments broadcast like numpy
arrays, and a call with plain numbers returns a plain float.

Edge costs: forward_time and backward_time are the same on every stage (the stage's transformer
layers). The first stage also runs the embedding and the last stage the output layer and the
loss, once per cell; `edge_forward_time` / `edge_backward_time` give those extra seconds (zero
unless a model knows them). The simulator adds them on the first and last stage; the slicer
prices each cell on the slowest kind of stage (layers plus the heavier edge).

Implementations:
- AnalyticCostModel (analytic.py): FLOP and byte counts of a GPT layer on a named GPU type.
- ProfiledCostModel (planner/profile/profiled_cost.py): fits measurements of a real Megatron layer.
- FunctionCostModel (here): wraps your own functions (tests, quick what-ifs).
Both layer-stack models share LayerStackCostModel (layer_stack.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional, Union

import numpy as np

from .arrays import ArrayLike, as_float_arrays, broadcast_shape, scalar_or_array


class CostModel(ABC):
    """Seconds and bytes of one pipeline stage (all its layers) for one cell."""

    @abstractmethod
    def forward_time(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike):
        """Seconds of the stage's forward pass over the cell."""

    @abstractmethod
    def backward_time(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike):
        """Seconds of the stage's backward pass over the cell (input and weight gradients)."""

    def slice_time(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike):
        """Forward plus backward: the t(l, c) of the TeraPipe paper for one stage."""
        return scalar_or_array(np.asarray(self.forward_time(batch, length, context))
                                + np.asarray(self.backward_time(batch, length, context)))

    @abstractmethod
    def transfer_time(self, batch: ArrayLike, length: ArrayLike):
        """Seconds to send one cell's activation [length, batch, hidden] to the next stage
        (the gradient going back has the same size and takes the same time)."""

    def receive_time(self, batch: ArrayLike, length: ArrayLike):
        """Seconds the receiving stage itself spends on a received message before the cell can
        use it, on top of transfer_time (which runs while the stage computes): 0, or the
        all-gather of scatter-gather messages (LayerStackCostModel)."""
        return scalar_or_array(np.zeros(broadcast_shape(batch, length)))

    @abstractmethod
    def activation_bytes(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike):
        """Bytes one stage keeps from a cell's forward until its backward (K/V excluded)."""

    @abstractmethod
    def kv_bytes(self, batch: ArrayLike, length: ArrayLike):
        """Bytes of the cell's keys and values one stage keeps for later token slices."""

    def edge_forward_time(self, batch: ArrayLike, length: ArrayLike, first_stage: ArrayLike,
                          last_stage: ArrayLike):
        """Seconds a cell's forward costs on top of forward_time on the first stage (embedding)
        and/or the last stage (output layer and loss): both on a one-stage pipeline, neither on a
        middle stage. The default is 0 (layers only, as before edge costs existed)."""
        return scalar_or_array(np.zeros(broadcast_shape(batch, length, first_stage, last_stage)))

    def edge_backward_time(self, batch: ArrayLike, length: ArrayLike, first_stage: ArrayLike,
                           last_stage: ArrayLike):
        """Backward counterpart of edge_forward_time (default 0)."""
        return scalar_or_array(np.zeros(broadcast_shape(batch, length, first_stage, last_stage)))

    def wgrad_time(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike,
                   first_stage: ArrayLike, last_stage: ArrayLike):
        """Seconds of a cell's backward (layers plus edges) that are weight-gradient GEMMs.

        With deferred weight gradients (TeraPipePlan.defer_wgrad) a backward cell costs this
        much less, and the sequence's W action costs the sum over its cells. The default is 0:
        the model cannot tell, and deferring is priced as a reordering only."""
        return scalar_or_array(np.zeros(broadcast_shape(batch, length, context, first_stage, last_stage)))

    def deferred_backward_saving(self, batch: ArrayLike, length: ArrayLike, context: ArrayLike,
                                 first_stage: ArrayLike, last_stage: ArrayLike):
        """Seconds a backward cell saves when its weight gradients are deferred. Default: their
        GEMMs' time (`wgrad_time`); a profile that measured deferred backward cells knows better
        (a short slice's W costs more as its own action than inside the backward)."""
        return self.wgrad_time(batch, length, context, first_stage, last_stage)

    def wgrad_hold_bytes(self, batch: ArrayLike, length: ArrayLike):
        """Bytes a stage keeps from a cell's backward until its sequence's W action when weight
        gradients are deferred: the linear layers' inputs and output gradients (default 0)."""
        return scalar_or_array(np.zeros(broadcast_shape(batch, length)))

    def describe(self) -> str:
        return type(self).__name__

    def recomputed_share(self, share: float = 1.0) -> float:
        """What share of a chunk's layer forward (a chunk of `share` of the stage's layers)
        each of its backwards reruns under activation recomputation (0: none)."""
        return 0.0

    def without_scatter_gather(self) -> "CostModel":
        """This model with whole messages between stages, as Megatron's own schedules send
        them (this one, unless it prices scatter-gather messages)."""
        return self


EDGE_PARTS = ("embedding", "output")  # first stage; last stage (final norm, output layer, loss)


def combine_edges(first_stage: ArrayLike, last_stage: ArrayLike, embedding: np.ndarray,
                  output: np.ndarray, shape: tuple[int, ...]) -> Union[float, np.ndarray]:
    """embedding where first_stage, plus output where last_stage, broadcast to `shape`."""
    first = np.asarray(first_stage, dtype=bool)
    last = np.asarray(last_stage, dtype=bool)
    total = np.where(first, embedding, 0.0) + np.where(last, output, 0.0)
    return scalar_or_array(np.broadcast_to(total, shape))


class FunctionCostModel(CostModel):
    """A cost model from plain functions of (batch, length, context) arrays.

    forward: seconds of the stage's forward; backward defaults to `backward_ratio` x forward.
    transfer(batch, length), activation(batch, length, context), kv(batch, length) default to
    zero seconds, and one byte per row per token for both memories.
    edge_forward(batch, length, first_stage, last_stage) and edge_backward(...) give the first
    and last stage's extra seconds; both default to zero. wgrad(batch, length, context,
    first_stage, last_stage): the weight-gradient seconds within backward (default zero).
    """

    def __init__(self, forward: Callable[..., ArrayLike],
                 backward: Optional[Callable[..., ArrayLike]] = None, backward_ratio: float = 2.0,
                 transfer: Optional[Callable[..., ArrayLike]] = None,
                 activation: Optional[Callable[..., ArrayLike]] = None,
                 kv: Optional[Callable[..., ArrayLike]] = None,
                 edge_forward: Optional[Callable[..., ArrayLike]] = None,
                 edge_backward: Optional[Callable[..., ArrayLike]] = None,
                 wgrad: Optional[Callable[..., ArrayLike]] = None, name: str = "function"):
        self._forward = forward
        self._backward = backward
        self._backward_ratio = backward_ratio
        self._transfer = transfer
        self._activation = activation
        self._kv = kv
        self._edge_forward = edge_forward
        self._edge_backward = edge_backward
        self._wgrad = wgrad
        self.name = name

    def forward_time(self, batch, length, context):
        b, l, c = as_float_arrays(batch, length, context)
        return scalar_or_array(np.broadcast_to(self._forward(b, l, c), np.broadcast(b, l, c).shape))

    def backward_time(self, batch, length, context):
        b, l, c = as_float_arrays(batch, length, context)
        if self._backward is None:
            return scalar_or_array(self._backward_ratio * np.asarray(self.forward_time(b, l, c)))
        return scalar_or_array(np.broadcast_to(self._backward(b, l, c), np.broadcast(b, l, c).shape))

    def transfer_time(self, batch, length):
        b, l = as_float_arrays(batch, length)
        if self._transfer is None:
            return scalar_or_array(np.zeros(np.broadcast(b, l).shape))
        return scalar_or_array(np.broadcast_to(self._transfer(b, l), np.broadcast(b, l).shape))

    def activation_bytes(self, batch, length, context):
        b, l, c = as_float_arrays(batch, length, context)
        if self._activation is None:
            return scalar_or_array(np.broadcast_to(b * l, np.broadcast(b, l, c).shape))
        return scalar_or_array(np.broadcast_to(self._activation(b, l, c), np.broadcast(b, l, c).shape))

    def kv_bytes(self, batch, length):
        b, l = as_float_arrays(batch, length)
        return scalar_or_array(b * l if self._kv is None else np.asarray(self._kv(b, l), dtype=np.float64))

    def _edge(self, fn, batch, length, first_stage, last_stage):
        if fn is None:
            return CostModel.edge_forward_time(self, batch, length, first_stage, last_stage)
        b, l = as_float_arrays(batch, length)
        first, last = np.asarray(first_stage, dtype=bool), np.asarray(last_stage, dtype=bool)
        shape = broadcast_shape(b, l, first, last)
        return scalar_or_array(np.broadcast_to(np.asarray(fn(b, l, first, last), dtype=np.float64), shape))

    def edge_forward_time(self, batch, length, first_stage, last_stage):
        return self._edge(self._edge_forward, batch, length, first_stage, last_stage)

    def edge_backward_time(self, batch, length, first_stage, last_stage):
        return self._edge(self._edge_backward, batch, length, first_stage, last_stage)

    def wgrad_time(self, batch, length, context, first_stage, last_stage):
        if self._wgrad is None:
            return super().wgrad_time(batch, length, context, first_stage, last_stage)
        b, l, c = as_float_arrays(batch, length, context)
        first, last = np.asarray(first_stage, dtype=bool), np.asarray(last_stage, dtype=bool)
        shape = broadcast_shape(b, l, c, first, last)
        return scalar_or_array(np.broadcast_to(
            np.asarray(self._wgrad(b, l, c, first, last), dtype=np.float64), shape))

    def describe(self) -> str:
        return self.name
