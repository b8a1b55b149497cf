"""TeraPipePlan: how one microbatch is cut into cells (batch slice x token slice).

A plan is pure data. It says how many rows each batch slice takes and, for every batch slice,
the token lengths of its slices. The executor, the simulator and the planner all read it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from .orders import order_names
from .field_checks import as_int_tuple as _as_int_tuple, checked_edges, checked_layout, \
    checked_wgrad_points

TokenSlices = Union[Sequence[int], Sequence[Sequence[int]]]


@dataclass(frozen=True)
class TeraPipePlan:
    """Token and batch slicing of one microbatch, plus the order cells run in.

    seq_slices: token lengths that sum to the sequence length, shared by every batch slice,
        or one such list per batch slice when the slices differ (e.g. [[1024, 1024], [2048]]).
    batch_slices: rows per batch slice, summing to the micro batch size; None means one slice
        holding the whole microbatch.
    order: a name in schedule/orders.py's registry: "1f1b" (warm-up, then one forward / one
        backward) or "gpipe" (all forwards, then all backwards), the order of the TeraPipe paper.
    predicted_time: seconds per iteration the planner expects, if a planner made this plan.
    defer_wgrad: compute a sequence's parameter gradients in one W action after its last
        backward cell, instead of per cell: thin GEMMs and one accumulation per parameter in
        every cell's backward (see megatron_terapipe.runtime.wgrad.store). The default: it is exact,
        and per iteration each parameter then accumulates once per sequence, however many token
        slices there are. False computes them in every backward cell (less memory held until
        the W action). Layers that cannot defer (Transformer Engine's) compute theirs at once
        either way.
    wgrad_points: with defer_wgrad, per pipeline stage, the token slices after whose backward
        that stage already computes the weight gradients deferred so far (an extra W action).
        A stage that would wait for its next output gradient there does useful work instead,
        and its last W gets shorter. Entry k is for stage k; missing entries mean none. The
        planner places them by simulation (`planner.place_wgrad_points`).
    virtual_stages: model chunks per pipeline rank (V > 1: K * V virtual stages, rank k
        holding k, K + k, ...; a cell goes through them in order, each chunk with its own K/V
        and W actions; V divides a stage's layers, `check_layers`). virtual_group: microbatches
        per group of the interleaved order (None: the fewest that make K units); virtual_warmup:
        at most this many of the second K - k - 1 warm-up forwards of Megatron's interleaved
        1F1B on stage k (None: all; fewer keep fewer activations alive, orders.py).
    wgrad_after: per stage, for each of its W actions in their default order, how many of
        its F and B actions run before it (empty: the defaults; `planner.plan_wgrad` fills it).
    virtual_placement: where the chunks sit: "ring" (rank k holds virtual stages k, K + k,
        ...: Megatron's) or "v" (2 chunks, rank k holding k and 2K - 1 - k: down the ranks and
        back, the loss on rank 0, as Zero Bubble's ZB-V; schedule/actions.py; the chunks
        built for it: megatron/model/v_chunks.py). chunk_layers: layers of each chunk when they
        differ (e.g. (3, 2) for a stage of 5 layers in a V, `v_chunk_layers`; empty: equal
        chunks). The runtime runs whatever chunks it is given; the model's chunks must hold
        these layers for the plan's timing to hold.
    edge_slices: ((n, slices), (m, slices)): the first n and last m microbatches cut into these
        token slices, the others whole (seq_slices of one slice; order 1f1b then keeps K - k
        sequences in flight on stage k, as Megatron's): they fill and drain the pipeline.
    """

    seq_slices: TokenSlices
    batch_slices: Optional[Sequence[int]] = None
    order: str = "1f1b"
    predicted_time: Optional[float] = None
    defer_wgrad: bool = True
    wgrad_points: Sequence[Sequence[int]] = ()
    virtual_stages: int = 1
    virtual_group: Optional[int] = None
    virtual_warmup: Optional[int] = None
    wgrad_after: Sequence[Sequence[int]] = ()
    virtual_placement: str = "ring"
    chunk_layers: Sequence[int] = ()
    edge_slices: Sequence = ()
    token_slices: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=True)

    def __post_init__(self) -> None:
        orders = order_names()
        if self.order not in orders:
            raise ValueError(
                f"TeraPipePlan order must be one of {orders}, got {self.order!r} "
                "(use order='1f1b' for low memory or order='gpipe' for the paper's order)"
            )
        raw = list(self.seq_slices) if self.seq_slices is not None else []
        if not raw:
            raise ValueError("TeraPipePlan.seq_slices is empty: give at least one token slice")
        nested = all(isinstance(s, (list, tuple)) for s in raw)
        if nested:
            per_batch = tuple(_as_int_tuple(s, "seq_slices[i]") for s in raw)
        elif any(isinstance(s, (list, tuple)) for s in raw):
            raise ValueError(
                "TeraPipePlan.seq_slices mixes numbers and lists: give one flat list of token "
                "lengths, or one list per batch slice"
            )
        else:
            per_batch = None
            flat = _as_int_tuple(raw, "seq_slices")
        batch = None
        if self.batch_slices is not None:
            batch = _as_int_tuple(self.batch_slices, "batch_slices")
            if not batch:
                raise ValueError("TeraPipePlan.batch_slices is empty: use None for no batch slicing")
            if any(b <= 0 for b in batch):
                raise ValueError(f"TeraPipePlan.batch_slices must all be positive, got {list(batch)}")
        if per_batch is not None:
            n_batch = len(batch) if batch is not None else 1
            if len(per_batch) != n_batch:
                raise ValueError(
                    f"TeraPipePlan.seq_slices has {len(per_batch)} per-batch-slice lists but there "
                    f"are {n_batch} batch slices: give one list per entry of batch_slices"
                )
            token_slices = per_batch
        else:
            token_slices = tuple(flat for _ in range(len(batch) if batch is not None else 1))
        for i, ts in enumerate(token_slices):
            if not ts:
                raise ValueError(f"TeraPipePlan: batch slice {i} has no token slices")
            if any(t <= 0 for t in ts):
                raise ValueError(
                    f"TeraPipePlan.seq_slices must all be positive token counts, got {list(ts)}"
                )
        if len({sum(ts) for ts in token_slices}) != 1:
            raise ValueError(
                "TeraPipePlan: every batch slice's token slices must sum to the same sequence "
                f"length, got sums {[sum(ts) for ts in token_slices]}"
            )
        object.__setattr__(self, "batch_slices", batch)
        object.__setattr__(self, "token_slices", token_slices)
        object.__setattr__(self, "wgrad_points", checked_wgrad_points(self, token_slices))
        object.__setattr__(self, "edge_slices", checked_edges(self))
        for name, value in zip(("virtual_stages", "wgrad_after", "chunk_layers"), checked_layout(self)):
            object.__setattr__(self, name, value)
        if per_batch is None:
            object.__setattr__(self, "seq_slices", flat)
        else:
            object.__setattr__(self, "seq_slices", per_batch)

    @property
    def chunk_shares(self) -> Optional[tuple[float, ...]]:
        """Each model chunk's part of a stage's layers (None: equal chunks)."""
        return tuple(n / sum(self.chunk_layers) for n in self.chunk_layers) or None

    def check_layers(self, layers_per_stage: int, where: str = "virtual_stages") -> None:
        """ValueError unless the plan's model chunks divide a stage's layers."""
        if self.chunk_layers:
            if sum(self.chunk_layers) != layers_per_stage:
                raise ValueError(f"chunk_layers {list(self.chunk_layers)} hold "
                                 f"{sum(self.chunk_layers)} layers, a pipeline stage "
                                 f"{layers_per_stage}: give layers that sum to a stage's")
            return
        if layers_per_stage % self.virtual_stages:
            raise ValueError(f"{where} {self.virtual_stages} does not divide the {layers_per_stage} "
                             "layers of a pipeline stage: use a divisor of them")

    def early_w_text(self) -> str:
        """'early W: stage 0 after slices [8, 7], ...' ('' without early W actions)."""
        early = [f"stage {k} after slices {list(p)}" for k, p in enumerate(self.wgrad_points) if p]
        return "early W: " + ", ".join(early) if early else ""

    def wgrad_points_of(self, stage: int) -> tuple[int, ...]:
        """Token slices after whose backward `stage` runs an extra W action."""
        return self.wgrad_points[stage] if stage < len(self.wgrad_points) else ()

    # ---- derived sizes -------------------------------------------------------------------
    seq_length = property(lambda self: sum(self.token_slices[0]))
    num_batch_slices = property(lambda self: len(self.token_slices))

    @property
    def uniform_token_slicing(self) -> bool:
        return len(set(self.token_slices)) == 1

    def rows(self, micro_batch_size: int) -> tuple[int, ...]:
        """Rows of each batch slice for a microbatch of `micro_batch_size` rows."""
        return self.batch_slices if self.batch_slices is not None else (micro_batch_size,)

    @property
    def num_cells(self) -> int:
        """Cells per microbatch (of microbatches that edge_slices does not cut)."""
        return sum(len(ts) for ts in self.token_slices)

    def slices_of(self, microbatch: int, num_microbatches: int) -> tuple[tuple[int, ...], ...]:
        """Token slices per batch slice of one microbatch: edge_slices' for the first and
        last ones, token_slices for the others."""
        (first, head), (last, tail) = self.edge_slices or ((0, ()), (0, ()))
        if microbatch < first:
            return (head,)
        return (tail,) if last and microbatch >= num_microbatches - last else self.token_slices

    def cells_of(self, microbatch: int, num_microbatches: int) -> int:
        """Cells of one microbatch (`slices_of`)."""
        return sum(map(len, self.slices_of(microbatch, num_microbatches)))

    # ---- checks against a run ------------------------------------------------------------
    def validate(self, seq_length: int, micro_batch_size: int, multiple_of: int = 1) -> None:
        """Raise ValueError naming the problem and the fix if the plan cannot run this shape.
        multiple_of: what every slice must be a multiple of (SliceGrid.tp_multiple)."""
        grid = SliceGrid(tp_multiple=max(1, multiple_of))
        grid.check_sum(self.token_slices[0], seq_length)
        if self.batch_slices is not None and sum(self.batch_slices) != micro_batch_size:
            raise ValueError(
                f"TeraPipe plan batch_slices {list(self.batch_slices)} sum to "
                f"{sum(self.batch_slices)} rows but micro_batch_size is {micro_batch_size}: "
                f"make batch_slices sum to {micro_batch_size}"
            )
        self.check_multiple_of(multiple_of)

    def check_multiple_of(self, multiple_of: int) -> None:
        """Sequence parallelism splits every slice over the tensor-parallel ranks."""
        SliceGrid(tp_multiple=max(1, multiple_of)).check_tp_multiple(
            self.token_slices + tuple(ts for _, ts in self.edge_slices))

    # ---- construction and serialisation ----------------------------------------------------
    @classmethod
    def uniform(cls, seq_length: int, num_slices: int, order: str = "1f1b",
                multiple_of: int = 1, batch_slices: Optional[Sequence[int]] = None) -> "TeraPipePlan":
        """Near-equal slices in units of `multiple_of` tokens, the larger ones first."""
        return SliceGrid(granularity=multiple_of).uniform(seq_length, num_slices, order, batch_slices)

    def to_dict(self) -> dict:
        return {
            "seq_slices": [list(ts) for ts in self.token_slices]
            if not self.uniform_token_slicing else list(self.token_slices[0]),
            "batch_slices": list(self.batch_slices) if self.batch_slices is not None else None,
            "order": self.order,
            "predicted_time": self.predicted_time,
            "defer_wgrad": self.defer_wgrad,
            "wgrad_points": [list(p) for p in self.wgrad_points],
            # left out at their defaults: files of plans without them read as before
            **{k: v for k, v, default in (
                ("virtual_stages", self.virtual_stages, 1),
                ("virtual_group", self.virtual_group, None),
                ("virtual_warmup", self.virtual_warmup, None),
                ("wgrad_after", [list(p) for p in self.wgrad_after], []),
                ("virtual_placement", self.virtual_placement, "ring"),
                ("chunk_layers", list(self.chunk_layers), []),
                ("edge_slices", [[n, list(ts)] for n, ts in self.edge_slices], []))
                if v != default},
        }

    @classmethod
    def from_dict(cls, data: dict) -> "TeraPipePlan":
        return cls(seq_slices=data["seq_slices"], batch_slices=data.get("batch_slices"),
                   order=data.get("order", "1f1b"), predicted_time=data.get("predicted_time"),
                   defer_wgrad=bool(data.get("defer_wgrad", True)),
                   wgrad_points=data.get("wgrad_points") or (),
                   virtual_stages=data.get("virtual_stages", 1),
                   virtual_group=data.get("virtual_group"),
                   virtual_warmup=data.get("virtual_warmup"),
                   wgrad_after=data.get("wgrad_after") or (),
                   virtual_placement=data.get("virtual_placement", "ring"),
                   chunk_layers=data.get("chunk_layers") or (),
                   edge_slices=data.get("edge_slices") or ())

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def describe(self) -> str:
        """One line for logs: rows x [token slices] per batch slice."""
        rows = self.batch_slices or ("all",)
        parts = [f"{r} rows: {list(ts)}" for r, ts in zip(rows, self.token_slices)]
        wgrad = "deferred" if self.defer_wgrad else "per cell"
        if self.wgrad_points:
            wgrad += f" ({self.early_w_text()})"
        wgrad += " (W placed)" if self.wgrad_after else ""
        parts += [f"{w} {n} microbatches: {list(ts)}" for w, (n, ts) in zip(("first", "last"),
                                                                            self.edge_slices) if n]
        return f"order={self.order}{self.chunks_text()}; wgrad={wgrad}; " + "; ".join(parts)

    def chunks_text(self) -> str:
        """'; V chunks per stage' (in a V, of their layers) on virtual stages, else ''."""
        layers = f" of {'+'.join(map(str, self.chunk_layers))} layers" if self.chunk_layers else ""
        shape = " in a V" if self.virtual_placement == "v" else ""
        return f"; {self.virtual_stages} chunks per stage{shape}{layers}" if self.virtual_stages > 1 else ""


def v_chunk_layers(layers_per_stage: int) -> tuple[int, ...]:
    """A V's 2 chunks of a stage of `layers_per_stage` layers: () when they split equally,
    else one more layer on the way down (chunk 0) than on the way back (chunk 1), e.g. (3, 2)."""
    if layers_per_stage < 2:
        raise ValueError(f"a V's 2 model chunks need 2 or more layers per stage, got "
                         f"{layers_per_stage}")
    if layers_per_stage % 2 == 0:
        return ()
    return ((layers_per_stage + 1) // 2, layers_per_stage // 2)


@dataclass(frozen=True)
class SliceNames:
    """What errors about slice lengths call things: Python's argument names (the default),
    or Megatron-LM's flags (megatron/args/settings.py)."""

    seq_length: str = "seq_length"
    granularity: str = "granularity"
    tensor_parallel: str = "the tensor-parallel size"
    num_slices: str = "num_slices"
    summed_slices: str = "TeraPipe plan slices"  # slices that must sum to the sequence; {slices}
    tp_slices: str = "TeraPipe token slices"  # slices that must be multiples of the TP size ...
    tp_multiple: str = "{tp}"  # ... of this


@dataclass(frozen=True)
class SliceGrid:
    """The token-slice lengths a run allows, and the checks that hold slices to them.

    Every slice is a multiple of `tp_multiple`: the tensor-parallel size under sequence
    parallelism (it splits each slice over the TP ranks), else 1. Slices the planner or a
    uniform cut makes are also multiples of `granularity` (the DP slicer's step): they come in
    whole `unit`s, the least common multiple of the two. Slices given by hand need only the TP
    multiple. The flags, the planner and the schedule's checks all cut and check through this.
    """

    granularity: int = 1
    tp_multiple: int = 1
    names: SliceNames = field(default=SliceNames(), compare=False)

    def __post_init__(self) -> None:
        if self.granularity <= 0:
            raise ValueError(f"{self.names.granularity} must be a positive number of tokens, "
                             f"got {self.granularity}")
        if self.tp_multiple <= 0:
            raise ValueError(f"{self.names.tensor_parallel} must be positive, got {self.tp_multiple}")

    @property
    def unit(self) -> int:
        """Tokens every slice the planner or a uniform cut makes is a multiple of."""
        return self.granularity * self.tp_multiple // math.gcd(self.granularity, self.tp_multiple)

    def units(self, seq_length: int) -> int:
        """How many units `seq_length` tokens hold; ValueError unless the unit divides it."""
        n = self.names
        if seq_length <= 0:
            raise ValueError(f"{n.seq_length} must be positive, got {seq_length}")
        if seq_length % self.unit:
            what = (f"{n.granularity} {self.granularity}" if self.unit == self.granularity else
                    f"the least common multiple {self.unit} of {n.granularity} {self.granularity} "
                    f"and {n.tensor_parallel} {self.tp_multiple} (sequence parallelism)")
            raise ValueError(f"{n.seq_length} {seq_length} is not a multiple of {what}: every "
                             f"slice length is a multiple of the slice unit ({self.unit} tokens); "
                             f"choose a {n.granularity} that divides {seq_length}")
        return seq_length // self.unit

    def uniform(self, seq_length: int, num_slices: int, order: str = "1f1b",
                batch_slices: Optional[Sequence[int]] = None) -> TeraPipePlan:
        """`num_slices` near-equal slices in whole units, the larger ones first."""
        n = self.names
        if num_slices <= 0:
            raise ValueError(f"{n.num_slices} must be a positive number of slices, got {num_slices}")
        units = self.units(seq_length)
        if num_slices > units:
            raise ValueError(
                f"{n.num_slices} {num_slices} is more than {n.seq_length} {seq_length} / "
                f"{self.unit}-token units = {units} slices: use at most {units} slices, or a "
                f"smaller {n.granularity}")
        base, extra = divmod(units, num_slices)
        slices = [(base + (1 if i < extra else 0)) * self.unit for i in range(num_slices)]
        return TeraPipePlan(seq_slices=slices, batch_slices=batch_slices, order=order)

    def check_sum(self, slices: Sequence[int], seq_length: int,
                  against: Optional[str] = None) -> None:
        """ValueError unless `slices` sum to `seq_length` tokens; `against` names the sequence
        in the message (default: '<seq_length name> is N')."""
        total = sum(slices)
        if total != seq_length:
            what = self.names.summed_slices.format(slices=" ".join(map(str, slices)))
            against = against or f"{self.names.seq_length} is {seq_length}"
            raise ValueError(f"{what} sum to {total} tokens but {against}: make the token slices "
                             f"(--terapipe-slices) sum to {seq_length}")

    def check_tp_multiple(self, token_slices: Sequence[Sequence[int]]) -> None:
        """ValueError unless every slice (per batch slice) is a multiple of `tp_multiple`."""
        n, tp = self.names, self.tp_multiple
        for ts in token_slices:
            bad = [t for t in ts if t % tp]
            if bad:
                raise ValueError(
                    f"{n.tp_slices} {bad} are not multiples of {n.tp_multiple.format(tp=tp)}, "
                    "which sequence parallelism requires (slices must be multiples of the "
                    f"tensor-parallel size {tp}): use slice lengths that are multiples of {tp}")
