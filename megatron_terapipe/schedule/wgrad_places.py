"""Where a stage's W actions run: a plan's `wgrad_after` applied to a stage's list.

The builder first lays out a stage's W actions in their default places (a sequence's W right
after its last backward, early ones after their slices' backwards). A plan that places them
(`TeraPipePlan.wgrad_after`, filled by the planner's list scheduling) gives, for each of those
W actions in that order, how many of the stage's F and B actions run before it; this module
moves them there. A W computes every weight gradient its sequence (on its chunk) deferred
since its previous W, so a later place only makes it cover the same backwards later (or, past
an early W's next backward, that one too), which the executor and the simulator both do.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .actions import Action


def default_places(actions: Sequence[Action]) -> list[int]:
    """For each W action of `actions`, how many F and B actions run before it."""
    out, compute = [], 0
    for a in actions:
        if a.kind == "W":
            out.append(compute)
        else:
            compute += 1
    return out


def place_weight_grads(actions: Sequence[Action], places: Optional[Sequence[int]],
                       stage: int) -> list[Action]:
    """`actions` (W actions in their default places) with W number i after `places[i]` F and
    B actions; None: as they are. Raises ValueError naming the stage and the W that a place
    would run before its own backward, or a count that does not match."""
    if places is None:
        return list(actions)
    weight_grads = [a for a in actions if a.kind == "W"]
    others = [a for a in actions if a.kind != "W"]
    if len(places) != len(weight_grads):
        raise ValueError(
            f"the TeraPipe plan places {len(places)} W actions on stage {stage} (wgrad_after) "
            f"but the schedule has {len(weight_grads)} there: plan the W places for this "
            "schedule (the same slices, microbatches, order and virtual stages), or leave "
            "wgrad_after unset (Megatron-LM: --terapipe-wgrad-placement off)")
    earliest = default_places(actions)
    for w, place, least in zip(weight_grads, places, earliest):
        if not least <= place <= len(others):
            raise ValueError(
                f"the TeraPipe plan places {w} on stage {stage} after {place} F/B actions "
                f"(wgrad_after), but it must run after its backward (at least {least}) and "
                f"within the stage's {len(others)} F/B actions")
    out: list[Action] = []
    i = 0
    for w, place in zip(weight_grads, places):
        out += others[i:place]
        i = max(i, place)
        out.append(w)
    return out + others[i:]
