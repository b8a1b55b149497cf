"""Progress of a long measurement, on stderr.

On a terminal: one bar, redrawn in place. Elsewhere (a log file, a pipe): a plain line at 25,
50, 75 and 100%, so that a log holds four lines, not one per measured cell.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO

MILESTONES = (25, 50, 75, 100)  # percent, where a log gets a line
BAR_WIDTH = 24


def is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """`step()` once per unit of work; `total` units in all."""

    def __init__(self, total: int, label: str = "measuring", stream: Optional[TextIO] = None,
                 enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and total > 0
        self.interactive = is_terminal(self.stream)
        self.last_milestone = 0

    def step(self, note: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.interactive:
            self._redraw(note)
        else:
            self._log_milestone()
        self.stream.flush()

    def _redraw(self, note: str) -> None:
        filled = BAR_WIDTH * min(self.done, self.total) // self.total
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        count = f"{self.done:>{len(str(self.total))}}/{self.total}"
        # padded, so that a shorter note overwrites all of a longer one
        self.stream.write(f"\r{self.label} [{bar}] {count} {note:<28.28}")
        if self.done == self.total:
            self.stream.write("\n")

    def _log_milestone(self) -> None:
        percent = 100 * self.done // self.total
        reached = [m for m in MILESTONES if self.last_milestone < m <= percent]
        if reached:
            self.last_milestone = reached[-1]
            self.stream.write(f"{self.label}: {self.done}/{self.total} ({reached[-1]}%)\n")
