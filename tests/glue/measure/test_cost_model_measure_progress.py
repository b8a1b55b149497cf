"""Progress of a measurement: a bar redrawn in place on a terminal, four lines in a log."""

from __future__ import annotations

import io

from megatron_terapipe.megatron.measure.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_at_each_quarter():
    log = io.StringIO()
    bar = Progress(40, "measuring layer", stream=log)
    for i in range(40):
        bar.step(f"cell {i}")
    lines = log.getvalue().splitlines()
    assert lines == ["measuring layer: 10/40 (25%)", "measuring layer: 20/40 (50%)",
                     "measuring layer: 30/40 (75%)", "measuring layer: 40/40 (100%)"]
    assert "\r" not in log.getvalue()


def test_few_steps_still_end_at_100_percent():
    log = io.StringIO()
    bar = Progress(3, "measuring edges", stream=log)
    for _ in range(3):
        bar.step()
    lines = log.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1] == "measuring edges: 3/3 (100%)"


def test_a_terminal_gets_one_line_redrawn():
    term = Terminal()
    bar = Progress(8, "measuring layer", stream=term)
    for i in range(8):
        bar.step(f"b=1 l={8 * (i + 1)} c=0")
    text = term.getvalue()
    assert text.count("\r") == 8 and text.count("\n") == 1 and text.endswith("\n")
    frames = text.strip("\n").split("\r")[1:]
    assert frames[0].startswith("measuring layer [" + "#" * 3 + "." * 21 + "] 1/8 b=1 l=8 c=0")
    assert frames[-1].startswith("measuring layer [" + "#" * 24 + "] 8/8 b=1 l=64 c=0")
    assert len({len(f) for f in frames}) == 1  # every frame overwrites the whole last one
    assert all(len(f) < 80 for f in frames)


def test_disabled_progress_writes_nothing():
    log = io.StringIO()
    bar = Progress(5, stream=log, enabled=False)
    for _ in range(5):
        bar.step()
    assert log.getvalue() == "" and bar.done == 5
