"""The orders a plan can name (`TeraPipePlan.order`): how a stage interleaves the forwards and
backwards of its cells.

An order is one function and one entry in ORDERS. The function gets, per microbatch, the
forward actions and the backward actions of its cells (both in forward cell order; every
stage gets the same objects), the stage and the number of stages, and returns the stage's
forwards and backwards in the order it runs them. build.py adds the W actions after and
`validate` checks the result (dependencies, reverse token order in backward, no deadlock). An
order must also run all of a microbatch's forwards on the last stage before that
microbatch's first backward there: the loss is normalised by the microbatch's token count.

Virtual stages (a plan's virtual_stages V > 1, V model chunks per rank) take each order's
chunked form (CHUNKED_ORDERS, same names): it gets the forwards and backwards per chunk and
microbatch, and the group size (microbatches per group of the interleaved order). A unit is
one cell's rows and tokens, (microbatch, batch slice, token slice); it runs on every chunk.

The registry is read by `TeraPipePlan` (which orders a plan may name), the `--terapipe-order`
flag and `terapipe-plan --order`. This module imports nothing of the package, so that
plan.py can read it.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

from ..plan.orders import use_registry

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
    first backward of that microbatch (exact loss normalisation). Microbatches cut into
    different numbers of cells (a plan's edge_slices) take `sequences_in_flight`."""
    if len({len(cells) for cells in forwards}) > 1:
        return sequences_in_flight(forwards, backwards, stage, num_stages)
    flat_forwards = [f for cells in forwards for f in cells]
    flat_backwards = [b for cells in backwards for b in reversed(cells)]
    warmup = min(len(flat_forwards), len(forwards[0]) - 1 + (num_stages - stage - 1))
    order = list(flat_forwards[:warmup])
    steady = len(flat_forwards) - warmup
    for f, b in zip(flat_forwards[warmup:], flat_backwards[:steady]):
        order += [f, b]
    return order + flat_backwards[steady:]


def sequences_in_flight(forwards: PerMicrobatch, backwards: PerMicrobatch, stage: int,
                        num_stages: int) -> list:
    """1F1B counted in sequences, for microbatches cut differently: stage k runs a forward
    while it keeps at most K - k sequences' tokens in flight (Megatron's 1F1B for whole
    sequences), else the next backward. A sequence counts until its first slice's backward
    (its W frees the slices' activations together); before the backward of a cut sequence,
    one slice fewer, which its K/V gradients take. A microbatch's forwards all run before
    its first backward."""
    flat_forwards = [f for cells in forwards for f in cells]
    flat_backwards = [b for cells in backwards for b in reversed(cells)]
    whole = sum(f.cell.tokens for f in forwards[0])
    order, in_flight, i = [], 0, 0
    for b in flat_backwards:
        limit = (num_stages - stage) * whole - (b.cell.tokens if b.cell.num_token_slices > 1 else 0)
        while i < len(flat_forwards) and (
                flat_forwards[i].cell.microbatch <= b.cell.microbatch
                or in_flight + flat_forwards[i].cell.tokens <= limit):
            order.append(flat_forwards[i])
            in_flight += flat_forwards[i].cell.tokens
            i += 1
        order.append(b)
        if b.cell.token_slice == 0:
            in_flight -= whole
    return order + flat_forwards[i:]


#: per chunk, per microbatch, its actions in forward cell order: [chunk][microbatch][cell]
PerChunk = Sequence[PerMicrobatch]
# (forwards, backwards, stage, stages, group, lead: TeraPipePlan.virtual_warmup)
ChunkedOrderFunction = Callable[[PerChunk, PerChunk, int, int, int, Optional[int]], list]


def _backward_units(per_microbatch: PerMicrobatch) -> list:
    """One chunk's backwards in backward unit order: microbatch by microbatch, each one's
    cells in reverse (later token slices first: their K/V gradients reach earlier slices)."""
    return [b for cells in per_microbatch for b in reversed(cells)]


def gpipe_chunked(forwards: PerChunk, backwards: PerChunk, stage: int, num_stages: int,
                  group: int, lead: Optional[int] = None) -> list:
    """All forwards, chunk by chunk (every unit through chunk 0, then chunk 1, ...), then all
    backwards in exactly reverse order (last chunk first)."""
    order = [f for per_mb in forwards for cells in per_mb for f in cells]
    return order + [b for per_mb in reversed(backwards) for cells in reversed(per_mb)
                    for b in reversed(cells)]


def interleaved_tables(forwards: PerChunk, backwards: PerChunk, group: int) -> tuple[list, list]:
    """Megatron's interleaved table over units: microbatches in groups of `group`, each group
    through chunk 0, then chunk 1, ... (forwards, units in cell order), and the backwards of
    the same groups through the chunks mirrored (last chunk first, units in backward order)."""
    num_chunks, num_microbatches = len(forwards), len(forwards[0])
    fwd, bwd = [], []
    for first in range(0, num_microbatches, group):
        mbs = range(first, min(first + group, num_microbatches))
        fwd += [f for c in range(num_chunks) for m in mbs for f in forwards[c][m]]
        bwd += [b for c in reversed(range(num_chunks)) for m in mbs for b in reversed(backwards[c][m])]
    return fwd, bwd


def interleaved_warmup(cells_per_microbatch: int, group: int, num_chunks: int, stage: int,
                       num_stages: int, lead: Optional[int] = None) -> int:
    """Forwards rank `stage` runs before its first backward: Megatron's interleaved warm-up in
    units ((K - k - 1) * 2 + (V - 1) * group units), plus the rest of the first microbatch's
    cells, so that the last rank forwards a whole microbatch on the last chunk before its
    first backward (exact loss normalisation). `lead`: at most this many of the second
    K - k - 1 (None: all; fewer keep fewer activations alive, and cost time where the
    steady state needs them to cover the ring: TeraPipePlan.virtual_warmup)."""
    units = group * cells_per_microbatch
    downstream = num_stages - stage - 1
    extra = downstream if lead is None else min(downstream, lead)
    return downstream + extra + (num_chunks - 1) * units + cells_per_microbatch - 1


def one_forward_one_backward_chunked(forwards: PerChunk, backwards: PerChunk, stage: int,
                                     num_stages: int, group: int,
                                     lead: Optional[int] = None) -> list:
    """Interleaved 1F1B over units (`interleaved_tables`): the warm-up forwards
    (`interleaved_warmup`), then one forward and one backward in turn, then the backwards
    left."""
    fwd, bwd = interleaved_tables(forwards, backwards, group)
    warmup = min(len(fwd), interleaved_warmup(len(forwards[0][0]), group, len(forwards),
                                              stage, num_stages, lead))
    order = list(fwd[:warmup])
    for f, b in zip(fwd[warmup:], bwd):
        order += [f, b]
    return order + bwd[len(fwd) - warmup:]


#: Every order by the name a plan gives it; the first is the default.
ORDERS: dict[str, OrderFunction] = {
    "1f1b": one_forward_one_backward,
    "gpipe": gpipe,
}

#: The same orders on virtual stages (virtual_stages > 1).
CHUNKED_ORDERS: dict[str, ChunkedOrderFunction] = {
    "1f1b": one_forward_one_backward_chunked,
    "gpipe": gpipe_chunked,
}


use_registry(lambda: ORDERS)  # the plan checks names against this registry (plan/orders.py)


def order_names() -> tuple[str, ...]:
    return tuple(ORDERS)
