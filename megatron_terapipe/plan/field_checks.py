"""Checks of TeraPipePlan's fields, run when a plan is made: whole numbers, early W points, edge
slicing, and the virtual-stage and W-point fields."""

from __future__ import annotations


def _whole(value) -> bool:
    """A positive int (bools are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def as_int_tuple(values, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a list of integers, got {values!r}") from None
    for v, raw in zip(out, values):
        if isinstance(raw, float) and raw != int(raw):
            raise ValueError(f"{what} must be whole numbers, got {raw!r}")
    return out


def checked_wgrad_points(plan, token_slices) -> tuple[tuple[int, ...], ...]:
    """wgrad_points: per stage, sorted token slices between 1 and the most slices - 1."""
    raw = plan.wgrad_points or ()
    if isinstance(raw, (str, bytes)) or not all(isinstance(p, (list, tuple)) for p in raw):
        raise ValueError(
            f"TeraPipePlan.wgrad_points must be one list of token slices per stage, got {raw!r}")
    points = tuple(tuple(sorted(set(as_int_tuple(p, "wgrad_points[k]")))) for p in raw)
    while points and not points[-1]:
        points = points[:-1]
    if points and not plan.defer_wgrad:
        raise ValueError("TeraPipePlan.wgrad_points needs defer_wgrad=True (they place "
                         "extra W actions for deferred weight gradients)")
    most = max(len(ts) for ts in token_slices)
    for k, p in enumerate(points):
        bad = [j for j in p if not 0 < j < most]
        if bad:
            raise ValueError(
                f"TeraPipePlan.wgrad_points for stage {k} name token slices {bad}; they "
                f"must be between 1 and {most - 1} (slice 0's backward always ends with "
                "a W action)")
    return points


def checked_edges(plan) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """edge_slices: ((first microbatches, their token slices), (last microbatches, theirs)),
    on a plan of whole sequences on one chunk per rank in the 1f1b order (the order then
    counts sequences in flight: schedule/orders.py)."""
    raw = plan.edge_slices or ()
    if not raw:
        return ()
    what = "TeraPipePlan.edge_slices"
    if isinstance(raw, (str, bytes)) or len(raw) != 2 or not all(
            isinstance(e, (list, tuple)) and len(e) == 2 for e in raw):
        raise ValueError(f"{what} must be ((first microbatches, [token slices]), (last "
                         f"microbatches, [token slices])), got {raw!r}")
    edges = tuple((as_int_tuple([n], what)[0], as_int_tuple(ts, what)) for n, ts in raw)
    seq = sum(plan.token_slices[0])
    if len(plan.token_slices) != 1 or len(plan.token_slices[0]) != 1 or plan.virtual_stages != 1 \
            or plan.order != "1f1b" or plan.wgrad_points:
        raise ValueError(f"{what} cut the first and last microbatches of a plan of whole "
                         "sequences: use seq_slices=[sequence length], no batch slices, "
                         "virtual_stages=1, order '1f1b' and no wgrad_points with them")
    for n, ts in edges:
        if n < 0 or not ts or min(ts) < 1 or sum(ts) != seq:
            raise ValueError(f"{what} must name 0 or more microbatches and positive token "
                             f"slices that sum to the sequence length {seq}, got {raw!r}")
    return edges if any(n for n, _ in edges) else ()


def checked_layout(plan) -> tuple[int, tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """virtual_stages (virtual_group and virtual_warmup with it), wgrad_after and the chunks'
    placement and layers, checked."""
    v, g, raw = plan.virtual_stages, plan.virtual_group, plan.wgrad_after or ()
    if not _whole(v) or (g is not None and not (_whole(g) and v > 1)):
        raise ValueError(f"TeraPipePlan.virtual_stages must be at least 1 model chunk per rank "
                         f"and virtual_group a number of microbatches (with virtual_stages > 1), "
                         f"got {v!r} and {g!r}")
    lead = plan.virtual_warmup
    if lead is not None and not (isinstance(lead, int) and not isinstance(lead, bool)
                                 and lead >= 0 and v > 1):
        raise ValueError("TeraPipePlan.virtual_warmup must be a number of forwards, 0 or more, "
                         f"with virtual_stages > 1, got {lead!r}")
    if isinstance(raw, (str, bytes)) or not all(isinstance(p, (list, tuple)) for p in raw):
        raise ValueError(f"TeraPipePlan.wgrad_after must be one list per stage, got {raw!r}")
    places = tuple(as_int_tuple(p, "wgrad_after[k]") for p in raw)
    if places and not plan.defer_wgrad:
        raise ValueError("TeraPipePlan.wgrad_after needs defer_wgrad=True (it places W actions)")
    for k, p in enumerate(places):
        if any(a < 0 for a in p) or any(b < a for a, b in zip(p, p[1:])):
            raise ValueError(f"TeraPipePlan.wgrad_after for stage {k} must be non-negative "
                             f"and non-decreasing (W actions keep their order), got {list(p)}")
    return v, places, checked_placement(plan)


PLACEMENTS = ("ring", "v")


def checked_placement(plan) -> tuple[int, ...]:
    """virtual_placement and chunk_layers checked; returns chunk_layers as a tuple."""
    if plan.virtual_placement not in PLACEMENTS:
        raise ValueError(f"TeraPipePlan.virtual_placement must be one of {PLACEMENTS}, got "
                         f"{plan.virtual_placement!r}")
    if plan.virtual_placement == "v" and plan.virtual_stages != 2:
        raise ValueError("TeraPipePlan.virtual_placement 'v' holds 2 model chunks per rank "
                         f"(down the ranks and back), got virtual_stages={plan.virtual_stages}")
    layers = as_int_tuple(plan.chunk_layers or (), "TeraPipePlan.chunk_layers")
    if layers and (len(layers) != plan.virtual_stages or min(layers) < 1):
        raise ValueError(f"TeraPipePlan.chunk_layers must give {plan.virtual_stages} positive "
                         f"layer counts, one per model chunk (virtual_stages), got {list(layers)}")
    return layers
