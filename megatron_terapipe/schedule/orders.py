"""The orders a plan can name (`TeraPipePlan.order`): how a stage interleaves the forwards and
backwards of its cells.

An order is one function and one entry in ORDERS. The function gets, per microbatch, the
forward actions and the backward actions of its cells (both in forward cell order; every
stage gets the same objects), the stage and the number of stages, and returns the stage's
forwards and backwards in the order it runs them. build.py adds the W actions after and
`validate` checks the result (dependencies, reverse token order in backward, no deadlock). An
order must also run all of a microbatch's forwards on the last stage before that
microbatch's first backward there: the loss is normalised by the microbatch's token count.

The registry is read by `TeraPipePlan` (which orders a plan may name), the `--terapipe-order`
flag and `terapipe-plan --order`. This module imports nothing of the package, so that
plan.py can read it.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
PerMicrobatch = Sequence[Sequence[T]]
OrderFunction = Callable[[PerMicrobatch, PerMicrobatch, int, int], list]


def gpipe(forwards: PerMicrobatch, backwards: PerMicrobatch, stage: int,
          num_stages: int) -> list:
    """All forwards in cell order, then all backwards in exactly reverse order (the TeraPipe
    paper's order: every slice's activations stay alive until the backwards)."""
    return ([f for cells in forwards for f in cells]
            + [b for cells in reversed(backwards) for b in reversed(cells)])


def one_forward_one_backward(forwards: PerMicrobatch, backwards: PerMicrobatch, stage: int,
                             num_stages: int) -> list:
    """Stage k first runs (cells of one microbatch - 1) + (num_stages - k - 1) forwards, then
    alternates one forward and one backward, then drains the backwards. Backwards go
    microbatch by microbatch, each microbatch's cells in reverse. Because the warm-up covers a
    whole microbatch, the last stage knows a microbatch's total token count before it runs the
    first backward of that microbatch (exact loss normalisation)."""
    flat_forwards = [f for cells in forwards for f in cells]
    flat_backwards = [b for cells in backwards for b in reversed(cells)]
    warmup = min(len(flat_forwards), len(forwards[0]) - 1 + (num_stages - stage - 1))
    order = list(flat_forwards[:warmup])
    steady = len(flat_forwards) - warmup
    for f, b in zip(flat_forwards[warmup:], flat_backwards[:steady]):
        order += [f, b]
    return order + flat_backwards[steady:]


#: Every order by the name a plan gives it; the first is the default.
ORDERS: dict[str, OrderFunction] = {
    "1f1b": one_forward_one_backward,
    "gpipe": gpipe,
}


def order_names() -> tuple[str, ...]:
    return tuple(ORDERS)
