"""The `terapipe-plan` output the README and docs/planner.md show is what the command prints
today: every line of the example (but the `planner:` line, which times this machine, and
lines cut short with "...") appears verbatim in a fresh run's output. The gpt3-1b example
only: the others take 8-25 s to plan."""

from __future__ import annotations

import os
import shlex

import pytest

from harness.paths import ROOT
from megatron_terapipe.planner.cli.command import main

COMMAND = "$ terapipe-plan --model gpt3-1b --hardware v100 --pipeline-stages 8 --seq-length 2048"


def example(path: str) -> tuple[list[str], list[str]]:
    """(the command's arguments, the lines shown under it) of the gpt3-1b example in `path`."""
    text = open(os.path.join(ROOT, path)).read()
    block = text[text.index(COMMAND):]
    block = block[:block.index("```")]
    lines = block.splitlines()
    command = " ".join(line.rstrip("\\").strip() for line in lines[:2])
    return shlex.split(command)[2:], lines[2:]


@pytest.fixture(scope="module")
def printed() -> dict[tuple[str, ...], set[str]]:
    """Each command's output, planned once for the module (about 9 s on this 2-core machine)."""
    return {}


@pytest.mark.parametrize("path", ["README.md", "docs/planner.md"])
def test_the_planner_example_is_todays_output(path, printed, capsys):
    args, shown = example(path)
    if tuple(args) not in printed:
        assert main(args) == 0
        printed[tuple(args)] = set(capsys.readouterr().out.splitlines())
    checked = [line for line in shown if "..." not in line and not line.startswith("planner:")]
    assert len(checked) >= 5
    stale = [line for line in checked if line not in printed[tuple(args)]]
    assert not stale, f"{path} shows lines terapipe-plan no longer prints: {stale}"
