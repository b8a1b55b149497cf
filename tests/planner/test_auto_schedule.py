"""Choosing the schedule (planner/schedule_choice.py): the table of Megatron's and TeraPipe's
schedules, the auto rule (the fastest that fits; TeraPipe only when at least 3% faster), and
terapipe-plan's table and auto line."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset
from megatron_terapipe.planner.cli.command import main
from megatron_terapipe.planner.cost.stage_memory import GiB, MemoryBudget, MemoryBudgetError
from megatron_terapipe.planner.schedule_choice import (AUTO_MIN_GAIN, MEGATRON, TERAPIPE,
                                                 ScheduleOption, ScheduleTable,
                                                 compare_schedules, interleaved_chunk_counts)
from megatron_terapipe.planner.search import SearchSpace

MODEL = model_preset("gpt3-1b")  # 24 layers


def table_for(num_microbatches: int, budget=None, stages: int = 4) -> ScheduleTable:
    layers = MODEL.num_layers // stages
    cost = AnalyticCostModel(MODEL, hardware_preset("a100"), layers_per_stage=layers)
    space = SearchSpace(1024, 2, stages, num_microbatches, granularity=64)
    return compare_schedules(cost, space, MemoryBudget(budget), layers)


def test_every_candidate_in_one_table_best_first():
    table = table_for(8)
    names = [o.name for o in table.options]
    chunks = interleaved_chunk_counts(6)
    assert chunks == [2, 3, 6]
    assert set(names) == {"Megatron 1F1B", "TeraPipe 1f1b", "TeraPipe gpipe",
                          *(f"Megatron interleaved, {v} chunks" for v in chunks)}
    times = [o.time for o in table.options]
    assert times == sorted(times) and all(o.fits for o in table.options)
    interleaved = [o for o in table.options if o.num_chunks > 1]
    megatron = next(o for o in table.options if o.name == "Megatron 1F1B")
    assert all(o.time < megatron.time for o in interleaved)  # smaller bubble, same work
    assert all(o.plan is not None for o in table.options if o.family == TERAPIPE)


def test_interleaved_needs_enough_microbatches():
    table = table_for(2)
    for o in table.options:
        if o.num_chunks > 1:
            assert not o.runnable and "at least 4 microbatches" in o.note
    assert [o.runnable for o in table.options] == sorted((o.runnable for o in table.options),
                                                         reverse=True)


def test_one_row_per_schedule_when_both_orders_lay_out_the_same_actions():
    """On one microbatch 1f1b and gpipe run every forward, then every backward: one row."""
    from megatron_terapipe.schedule import build_schedule

    one = table_for(1)
    terapipe = [o for o in one.options if o.family == TERAPIPE and o.num_chunks == 1]
    assert [o.name for o in terapipe] == ["TeraPipe 1f1b"]
    assert terapipe[0].note.endswith("; gpipe: the same actions")
    plan = terapipe[0].plan
    lists = [build_schedule(p, 1, 4, 2).stages for p in (plan, replace(plan, order="gpipe"))]
    assert [[(a.kind, a.cell) for a in stage] for stage in lists[0]] == \
        [[(a.kind, a.cell) for a in stage] for stage in lists[1]]
    # eight microbatches: the orders differ, both rows stay (test_every_candidate_...)
    assert {"TeraPipe 1f1b", "TeraPipe gpipe"} <= {o.name for o in table_for(8).options}


def test_a_budget_marks_what_does_not_fit():
    free = table_for(8)
    gpipe = next(o for o in free.options if o.name == "TeraPipe gpipe")
    one_f_one_b = next(o for o in free.options if o.name == "TeraPipe 1f1b")
    budget = (max(gpipe.totals) + max(one_f_one_b.totals)) / 2
    assert max(one_f_one_b.totals) < budget < max(gpipe.totals)
    tight = table_for(8, budget)
    for o in tight.options:
        assert o.fits == (max(o.totals) <= budget)
        assert ("does not fit" in o.note) == (not o.fits)
    fits = [o.fits for o in tight.options]
    assert fits == sorted(fits, reverse=True)  # fitting rows first
    assert tight.auto().chosen.fits


def option(name, family, time, fits=True):
    return ScheduleOption(name, family, "1f1b", result=SimpleNamespace(iteration_time=time),
                          totals=(1.0,), fits=fits)


@pytest.mark.parametrize("terapipe_time,expected", [
    (0.90, "TeraPipe 1f1b"),  # 10% faster: TeraPipe
    (0.969, "TeraPipe 1f1b"),  # 3.1% faster
    (0.975, "Megatron interleaved, 2 chunks"),  # 2.5% faster: not enough
    (1.05, "Megatron interleaved, 2 chunks"),
])
def test_auto_needs_terapipe_3_percent_faster(terapipe_time, expected):
    options = sorted([option("Megatron interleaved, 2 chunks", MEGATRON, 1.0),
                      option("Megatron 1F1B", MEGATRON, 1.2),
                      option("TeraPipe 1f1b", TERAPIPE, terapipe_time)], key=lambda o: o.time)
    choice = ScheduleTable(tuple(options), MemoryBudget(None)).auto()
    assert AUTO_MIN_GAIN == 0.03
    assert choice.chosen.name == expected
    runner = "TeraPipe 1f1b" if expected.startswith("Megatron") else "Megatron interleaved, 2 chunks"
    assert choice.runner_up.name == runner
    assert choice.margin == pytest.approx(choice.runner_up.time / choice.chosen.time - 1)


def test_auto_takes_terapipe_when_megatron_does_not_fit_and_fails_when_nothing_does():
    options = (option("TeraPipe 1f1b", TERAPIPE, 1.0), option("Megatron 1F1B", MEGATRON, 0.9, False))
    choice = ScheduleTable(options, MemoryBudget(1.0)).auto()
    assert choice.chosen.name == "TeraPipe 1f1b" and "do not fit" in choice.reason
    nothing = (option("TeraPipe 1f1b", TERAPIPE, 1.0, False), option("Megatron 1F1B", MEGATRON, 0.9, False))
    with pytest.raises(MemoryBudgetError, match="no pipeline schedule fits"):
        ScheduleTable(nothing, MemoryBudget(1.0)).auto()


BASE = ["--model", "gpt3-1b", "--pipeline-stages", "4", "--seq-length", "1024",
        "--granularity", "64", "--micro-batch-size", "2", "--num-microbatches", "8",
        "--hardware", "a100"]


def test_cli_prints_the_schedule_table_and_auto(capsys):
    assert main(BASE) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("schedules, best first"))
    rows = [line for line in lines[start + 2:] if line.startswith("  ")]
    names = [" ".join(r.split()[:2]) for r in rows]
    assert {"Megatron 1F1B", "TeraPipe 1f1b", "TeraPipe gpipe", "Megatron interleaved,"} <= set(names)
    # Megatron's 1F1B and interleaved on 2, 3 and 6 chunks; TeraPipe in each order on 1, 2, 3
    # and 6 chunks per stage (--virtual-stages auto: every divisor of the 6 layers), and on 2
    # chunks in a V
    assert len(rows) == 4 + 2 * 4 + 2
    assert sum(", 2 chunks in a V" in r for r in rows) == 2
    assert sum(", 6 chunks" in r for r in rows) == 3
    times = [float(r.split(" ms")[0].split()[-1]) for r in rows]
    assert times == sorted(times)
    assert any(line.startswith("auto: ") and "runner-up" in line for line in lines)


def test_cli_budget_marks_rows_and_exits_1_when_nothing_fits(capsys):
    assert main(BASE + ["--memory-budget", "9GiB"]) == 0
    out = capsys.readouterr().out
    assert "budget 9.00 GiB per GPU" in out and "does not fit" in out
    assert main(BASE + ["--memory-budget", "1GiB", "--order", "gpipe"]) == 1
    out = capsys.readouterr().out
    assert "gpipe: no gpipe plan fits the memory budget of 1.00 GiB" in out
    assert "auto: no schedule fits the memory budget" in out


@pytest.mark.parametrize("flag,value", [
    ("--memory-budget", "seventy"), ("--memory-budget", "0"),
    ("--model-state-memory", "2 parsecs"), ("--memory-profile", "/nonexistent/memory.json"),
    ("--data-parallel-size", "0")])
def test_bad_memory_flags_are_named(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(BASE + [flag, value])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_model_state_follows_megatrons_accounting(capsys):
    main(BASE + ["--memory-budget", "80GiB"])
    plain = capsys.readouterr().out
    main(BASE + ["--memory-budget", "80GiB", "--distributed-optimizer", "--data-parallel-size", "8"])
    sharded = capsys.readouterr().out
    main(BASE + ["--memory-budget", "80GiB", "--model-state-memory", "3GiB"])
    given = capsys.readouterr().out

    def state(out):
        line = next(x for x in out.splitlines() if x.startswith("memory:"))
        return line.split("optimizer state ")[1]

    assert state(given) == "3.00 GiB per stage"
    low = float(state(plain).split()[0])
    assert float(state(sharded).split()[0]) == pytest.approx(low * (6 + 12 / 8) / 18, rel=0.01)
    # a middle stage: 6 layers of about 12 h^2 parameters (h = 2048) at 18 bytes each
    assert low * GiB == pytest.approx(6 * 12 * 2048 ** 2 * 18, rel=0.01)


@pytest.mark.parametrize("margin,phrase", [(0.033, "predicted 3.3% faster than the runner-up"),
                                           (8.786, "predicted 9.79x as fast as the runner-up")])
def test_auto_line_reads_as_a_sentence(margin, phrase):
    from megatron_terapipe.planner.cli.report import auto_text

    option = lambda name: SimpleNamespace(name=name, fits=True)  # noqa: E731
    choice = SimpleNamespace(chosen=option("TeraPipe 1f1b"), runner_up=option("Megatron 1F1B"),
                             margin=margin, reason="the fastest schedule that fits")
    assert auto_text(choice) == (f"auto: TeraPipe 1f1b, {phrase} Megatron 1F1B "
                                 "(the fastest schedule that fits)")
