"""The orders a plan can name (`TeraPipePlan.order`), as names only.

How each order lays out a stage's forwards and backwards lives with the schedule
(schedule/orders.py), whose registry is keyed by exactly these names; the plan checks a name
against this tuple without importing the schedule.
"""

from __future__ import annotations

#: 1f1b: warm-up, then one forward / one backward; gpipe: every forward, then every backward.
#: The first is the default.
ORDER_NAMES: tuple[str, ...] = ("1f1b", "gpipe")


def order_names() -> tuple[str, ...]:
    return ORDER_NAMES
