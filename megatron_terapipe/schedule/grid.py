"""The stage x step grid of a schedule as text, for errors and logs.

Like torch.distributed.pipelining's pipeline-order table: one column per stage, one row per
step (the position in that stage's list), with the step a check failed on marked.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .actions import Action, format_action

MARK_LEFT, MARK_RIGHT = ">>", "<<"
CONTEXT_STEPS = 6  # rows shown on each side of a marked step
UNMARKED_STEPS = 24  # rows shown from the top when no step is marked


def format_grid(stages: Sequence[Sequence[Action]], mark: Optional[tuple[int, int]] = None) -> str:
    """Rows `step NN | stage 0 action | stage 1 action ...`; `mark` = (stage, step) is shown as
    `>>F(m0b0t1)<<` and its row ends with `<- here`. Long lists show the rows around the mark
    (or the first rows) and say how many were left out."""
    steps = max((len(actions) for actions in stages), default=0)
    if mark is not None:
        first, last = max(0, mark[1] - CONTEXT_STEPS), min(steps, mark[1] + CONTEXT_STEPS + 1)
    else:
        first, last = 0, min(steps, UNMARKED_STEPS)
    cells = [[_cell(stages, k, step, mark) for k in range(len(stages))]
             for step in range(first, last)]
    width = max([len(f"stage {k}") for k in range(len(stages))] +
                [len(text) for row in cells for text in row] + [1])
    lines = ["step | " + " | ".join(f"stage {k}".ljust(width) for k in range(len(stages))).rstrip()]
    if first > 0:
        lines.append(f"  ... {first} earlier steps")
    for step, row in zip(range(first, last), cells):
        here = "  <- here" if mark is not None and step == mark[1] else ""
        lines.append(f"{step:4d} | " + " | ".join(t.ljust(width) for t in row).rstrip() + here)
    if last < steps:
        lines.append(f"  ... {steps - last} later steps")
    return "\n".join(lines)


def _cell(stages: Sequence[Sequence[Action]], k: int, step: int,
          mark: Optional[tuple[int, int]]) -> str:
    if step >= len(stages[k]):
        return ""
    text = format_action(stages[k][step])
    return f"{MARK_LEFT}{text}{MARK_RIGHT}" if mark == (k, step) else text
