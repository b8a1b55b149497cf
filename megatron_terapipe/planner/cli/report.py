"""Plans as text: compact slice lists, a to-scale picture of one microbatch's cells, the
comparison table of the plans the search timed, and the table of schedules (Megatron's and
TeraPipe's) with the auto choice, as terapipe-plan prints them."""

from __future__ import annotations

from typing import Optional, Sequence

from ...plan import TeraPipePlan
from ..cost.stage_memory import MemoryBudget
from ..schedule_choice import AutoChoice, ScheduleOption, ScheduleTable
from ..search import SearchResult

GiB = 1024 ** 3


def compact_slices(lengths: Sequence[int]) -> str:
    """'[256x4, 128] (5 slices)': runs of equal lengths as length x count."""
    out, i = [], 0
    while i < len(lengths):
        j = i
        while j < len(lengths) and lengths[j] == lengths[i]:
            j += 1
        out.append(f"{lengths[i]}" if j - i == 1 else f"{lengths[i]}x{j - i}")
        i = j
    return "[" + ", ".join(out) + f"] ({len(lengths)} slices)"


def slices_text(plan: TeraPipePlan) -> list[str]:
    """The plan's token (and batch) slices, compactly, one line per differing batch slice."""
    if plan.num_batch_slices == 1:
        return [f"  token slices: {compact_slices(plan.token_slices[0])}"] + [
            f"  {w} {n} microbatches: {compact_slices(ts)}"
            for w, (n, ts) in zip(("first", "last"), plan.edge_slices) if n]
    rows = plan.batch_slices or ()
    if plan.uniform_token_slicing:
        return [f"  batch slices: {list(rows)} rows, each cut into "
                f"{compact_slices(plan.token_slices[0])}"]
    lines = [f"  batch slices: {list(rows)} rows"]
    for r, ts in zip(rows, plan.token_slices):
        lines.append(f"    {r} rows: {compact_slices(ts)}")
    return lines


def memory_text(peaks: Sequence[float]) -> str:
    """Peak GiB per stage; past 12 stages the first six and the last two."""
    values = [p / GiB for p in peaks]
    if len(values) <= 12:
        return " ".join(f"{v:.2f}" for v in values)
    head = " ".join(f"{v:.2f}" for v in values[:6])
    tail = " ".join(f"{v:.2f}" for v in values[-2:])
    return f"{head} ... {tail}"


def comparison_lines(result: SearchResult, budget: Optional[MemoryBudget] = None) -> list[str]:
    """The table of the plans the search timed: iteration, bubble, peak memory, speedup over
    the baseline (no token slicing), then the one-chunk plan's peak memory per stage. With a
    budget, peaks count its model state too (as the schedule table does: the numbers the
    budget is checked against), and plans over it say so."""
    baseline = result.baseline.time
    totals = budget.totals if budget is not None else tuple
    lines = [f"{'':24} {'iteration':>12} {'bubble':>7} {'peak GiB/stage':>15} {'speedup':>8}"]
    for row in result.rows:
        r = row.result
        over = budget is not None and not budget.fits(r.peak_memory_bytes)
        peak = max(totals(r.peak_memory_bytes)) / GiB
        lines.append(f"{row.label:24} {r.iteration_time * 1e3:>9.2f} ms "
                     f"{100 * r.bubble_fraction:>6.1f}% {peak:>15.2f} "
                     f"{baseline / r.iteration_time:>7.2f}x" + ("  does not fit" if over else ""))
    counted = "activations + K/V" + (" + model state" if budget is not None else "")
    lines.append(f"peak GiB per stage ({counted}), the one-chunk plan: "
                 + memory_text(totals(result.chosen.result.peak_memory_bytes)))
    return lines


def schedule_table_lines(table: ScheduleTable) -> list[str]:
    """One row per schedule, best first: predicted iteration, speedup over Megatron's 1F1B,
    peak GiB per stage (activations + K/V + weights, gradients and optimizer state), the plan
    in brief, and "does not fit" where it does not."""
    base = megatron_1f1b_time(table)
    budget = table.budget
    lines = [f"schedules, best first ({budget.limit_text()}; peaks count activations, K/V and "
             f"{budget.state_text()} of weights, gradients and optimizer state):",
             f"  {'':30} {'iteration':>12} {'vs 1F1B':>8} {'bubble':>6}  peak GiB per stage"]
    return lines + ["  " + schedule_row(o, base) for o in table.options]


def megatron_1f1b_time(table: ScheduleTable) -> Optional[float]:
    """Megatron's 1F1B's predicted iteration, the table's "vs 1F1B" base (None: cannot run)."""
    return next((o.time for o in table.options if o.name == "Megatron 1F1B" and o.runnable), None)


def schedule_row(o: ScheduleOption, base: Optional[float]) -> str:
    if not o.runnable:
        return f"{o.name:30} {'-':>12} {'-':>8} {'-':>6}  {o.note}"
    speedup = f"{base / o.time:>7.2f}x" if base else f"{'-':>8}"
    bubble = f"{100 * o.result.bubble_fraction:>5.1f}%"
    note = f"  {o.note}" if o.note else ""
    return (f"{o.name:30} {o.time * 1e3:>9.2f} ms {speedup} {bubble}  {memory_text(o.totals)}"
            f"{note}")


def auto_text(choice: AutoChoice) -> str:
    """What --pipeline-schedule auto would run, the runner-up and the predicted margin."""
    text = f"auto: {choice.chosen.name}"
    if choice.runner_up is not None and choice.margin is not None:
        runner = choice.runner_up.name + ("" if choice.runner_up.fits else ", which does not fit")
        if choice.margin >= 0:
            text += f", predicted {_faster_than(choice.margin)} the runner-up {runner}"
        else:
            text += f"; the runner-up {runner} is predicted {100 * -choice.margin:.1f}% faster"
    return text + f" ({choice.reason})"


def _faster_than(margin: float) -> str:
    """'3.3% faster than', or '9.79x as fast as' from twice as fast on."""
    return f"{100 * margin:.1f}% faster than" if margin < 1.0 else f"{1.0 + margin:.2f}x as fast as"


def slice_picture(plan: TeraPipePlan, width: int = 60) -> list[str]:
    """One microbatch's cells to scale: a row per batch slice, a box per token slice as wide as
    its share of the sequence, labelled with its length where the label fits. Each row is the
    batch slice's name and `width` + 1 columns of boxes."""
    rows = plan.batch_slices or (None,)
    names = ["all rows" if r is None else f"{r} row" + ("s" if r != 1 else "") for r in rows]
    pad = max(len(n) for n in names)
    return [f"{name:>{pad}} {_boxes(ts, width)}" for name, ts in zip(names, plan.token_slices)]


def _boxes(lengths: Sequence[int], width: int) -> str:
    if len(lengths) > width:
        return f"({len(lengths)} slices: too many to draw in {width} columns)"
    out = []
    for length, columns in zip(lengths, _columns(lengths, width)):
        label = str(length)
        inside = columns - 1  # one column is the box's left edge
        out.append("|" + (label.center(inside) if len(label) <= inside else " " * inside))
    return "".join(out) + "|"


def _columns(lengths: Sequence[int], width: int) -> list[int]:
    """Columns per box, at least one each, the rest shared in proportion to the lengths
    (largest remainders), adding up to `width`."""
    spare, total = width - len(lengths), sum(lengths)
    exact = [spare * length / total for length in lengths]
    columns = [1 + int(e) for e in exact]
    by_remainder = sorted(range(len(lengths)), key=lambda i: int(exact[i]) - exact[i])
    for i in by_remainder[:width - sum(columns)]:
        columns[i] += 1
    return columns
