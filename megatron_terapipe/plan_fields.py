"""Checks of TeraPipePlan's fields that plan.py runs when a plan is made (kept apart so that
plan.py stays readable): whole numbers, and the virtual-stage and W-placement fields."""

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
