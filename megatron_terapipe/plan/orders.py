"""The orders a plan can name (`TeraPipePlan.order`), as names only.

How each order lays out a stage's forwards and backwards lives with the schedule
(schedule/orders.py). The plan checks a name without importing the schedule: the schedule's
registry hands this module its names when it is imported (`use_registry`), so a new order is
one function and one entry there; before that, the names are the two built-in orders.
"""

from __future__ import annotations

from typing import Callable, Iterable

#: 1f1b: warm-up, then one forward / one backward; gpipe: every forward, then every backward.
#: The first is the default.
ORDER_NAMES: tuple[str, ...] = ("1f1b", "gpipe")

_names: Callable[[], Iterable[str]] = lambda: ORDER_NAMES


def use_registry(names: Callable[[], Iterable[str]]) -> None:
    """Read the order names from the schedule's registry from now on."""
    global _names
    _names = names


def order_names() -> tuple[str, ...]:
    return tuple(_names())
