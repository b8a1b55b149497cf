"""The predicted peak memory per stage against the measured one, on CPU pipelines of 2 and 4
stages: a memory profile of the model is measured (megatron/measure/memory.py), the simulator
predicts each plan's peak per stage with it, and real runs measure the peak of what each stage
keeps for backward (saved tensors, K/V gradient buffers, deferred pieces). Every stage of every
case must be within 10%, on one chunk per stage and on virtual stages, also with Megatron's
full recomputation (the profile measured without it, as the planner's RecomputedMemory takes
it). Then a budget that the best
unconstrained plan exceeds: the plan the search returns within it must measure at most the
budget on every stage."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from harness import TinyGPT, spawn
from harness.measured.memory_runs import MemoryRun
from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner import FunctionCostModel, simulate
from megatron_terapipe.planner.cost.recompute_time import FullRecompute
from megatron_terapipe.planner.cost.recompute_memory import with_recompute
from megatron_terapipe.planner.cost.stage_memory import MemoryBudget
from megatron_terapipe.planner.profile.memory_fit import FittedMemory
from megatron_terapipe.planner.memory_search import search_within_budget
from megatron_terapipe.planner.search import SearchSpace, search
from megatron_terapipe.schedule import build_schedule
from megatron_terapipe.schedule.build import default_places

#: 4 stages repeat the 2-stage property on more stages (slow: .ci/run runs them).
STAGES = [2, pytest.param(4, marks=pytest.mark.slow)]
TOLERANCE = 0.10
SEQ = 128


def model(stages: int) -> TinyGPT:
    return TinyGPT(num_layers=2 * stages, hidden_size=64, num_attention_heads=4, vocab_size=128,
                   seq_length=SEQ)


def plan(slices: int, order: str, defer: bool, batch_slices=None) -> TeraPipePlan:
    return replace(TeraPipePlan.uniform(SEQ, slices, order=order, multiple_of=8,
                                        batch_slices=batch_slices), defer_wgrad=defer)


def grid(stages: int) -> list[MemoryRun]:
    """Orders, slice counts, batch slices, 1-8 microbatches, both weight-gradient modes, and
    Megatron's 1F1B."""
    runs = [MemoryRun("megatron_1f1b M4", None, 4, 1)]
    for order in ("1f1b", "gpipe"):
        for n, M, defer in [(1, 1, False), (4, 4, False), (8, 8, True), (16, 2, True)]:
            runs.append(MemoryRun(f"{order} n{n} M{M} W{defer:d}", plan(n, order, defer), M, 1))
        runs.append(MemoryRun(f"{order} n4 b1x2 M2", plan(4, order, False, [1, 1]), 2, 2))
    return runs


@pytest.fixture(scope="module")
def profile() -> FittedMemory:
    import json
    import tempfile

    data = spawn(1, "harness.measured.memory_runs:measure_memory_profile", model(1), 8, timeout=900)[0]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(data, fh)
    return FittedMemory.load(fh.name, layers_per_stage=2)


def time_model() -> FunctionCostModel:
    """Any times will do for memory; these make several slices worth their overhead."""
    return FunctionCostModel(lambda b, l, c: 1e-4 * b * (l + 0.5 * c) + 2e-3)


def predicted(run: MemoryRun, stages: int, memory: FittedMemory) -> tuple[float, ...]:
    p = run.plan or TeraPipePlan([SEQ], order="1f1b", defer_wgrad=False)
    schedule = build_schedule(p, run.num_microbatches, stages, run.micro_batch_size)
    return simulate(schedule, time_model(), memory=memory, megatron=run.plan is None).peak_memory_bytes


@pytest.mark.parametrize("stages", STAGES)
def test_predicted_peaks_within_10_percent(stages, profile):
    runs = grid(stages)
    measured = spawn(stages, "harness.measured.memory_runs:measure_run_peaks", model(stages), runs,
                     timeout=1200)
    errors = []
    for run in runs:
        for k, guess in enumerate(predicted(run, stages, profile)):
            actual = measured[k][run.name]
            error = guess / actual - 1.0
            if abs(error) > TOLERANCE:
                errors.append(f"{run.name} stage {k}: predicted {guess:.0f} B, measured "
                              f"{actual:.0f} B ({100 * error:+.1f}%)")
    assert not errors, "\n".join(errors)


#: uniform groups of 1 and of the stage's 2 layers, and block (the first layer of each stage)
RECOMPUTE = [FullRecompute("uniform", 1),
             pytest.param(FullRecompute("uniform", 2), marks=pytest.mark.slow),
             FullRecompute("block", 1)]


def recompute_grid() -> list[MemoryRun]:
    return [MemoryRun("megatron_1f1b M4", None, 4, 1),
            MemoryRun("1f1b n4 M4 W0", plan(4, "1f1b", False), 4, 1),
            MemoryRun("gpipe n4 M4 W0", plan(4, "gpipe", False), 4, 1),
            MemoryRun("1f1b n8 M8 W1", plan(8, "1f1b", True), 8, 1),
            MemoryRun("gpipe n16 M2 W1", plan(16, "gpipe", True), 2, 1)]


@pytest.mark.parametrize("recompute", RECOMPUTE, ids=lambda r: f"{r.method}{r.num_layers}")
def test_recomputed_peaks_within_10_percent(recompute, profile):
    """Megatron's full recomputation on 2 stages of 2 layers: each checkpointed group keeps
    its input, its backward brings its activations back; TeraPipe keeps its K/V buffers."""
    stages, runs = 2, recompute_grid()
    cfg = replace(model(stages), recompute_granularity="full", recompute_method=recompute.method,
                  recompute_num_layers=recompute.num_layers)
    memory = with_recompute(profile, recompute, cfg.hidden_size, dtype_bytes=4)
    measured = spawn(stages, "harness.measured.memory_runs:measure_run_peaks", cfg, runs, timeout=1200)
    errors = []
    for run in runs:
        guess, without = predicted(run, stages, memory), predicted(run, stages, profile)
        for k in range(stages):
            actual = measured[k][run.name]
            assert guess[k] < without[k], f"{run.name} stage {k}: recomputation saves nothing"
            if abs(guess[k] / actual - 1.0) > TOLERANCE:
                errors.append(f"{run.name} stage {k}: predicted {guess[k]:.0f} B, measured "
                              f"{actual:.0f} B ({100 * (guess[k] / actual - 1.0):+.1f}%)")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("stages", STAGES)
def test_interleaved_peaks_within_10_percent(stages, profile):
    """Megatron's interleaved 1F1B, 2 chunks of one layer per stage, 4 microbatches."""
    from megatron_terapipe.schedule import build_interleaved_schedule

    measured = spawn(stages, "harness.measured.memory_runs:measure_interleaved_peak", model(stages), 2, 4,
                     timeout=1200)
    schedule = build_interleaved_schedule(SEQ, 4, stages, 2, 1)
    for k, guess in enumerate(simulate(schedule, time_model(), memory=profile).peak_memory_bytes):
        assert guess == pytest.approx(measured[k], rel=TOLERANCE), f"stage {k}"


def test_interleaved_recomputed_peaks_within_10_percent(profile):
    """Megatron's interleaved 1F1B with full recomputation: each one-layer chunk is a group."""
    from megatron_terapipe.schedule import build_interleaved_schedule

    stages, recompute = 2, FullRecompute("uniform", 1)
    cfg = replace(model(stages), recompute_granularity="full")
    measured = spawn(stages, "harness.measured.memory_runs:measure_interleaved_peak", cfg, 2, 4,
                     timeout=1200)
    memory = with_recompute(profile, recompute, cfg.hidden_size, dtype_bytes=4)
    schedule = build_interleaved_schedule(SEQ, 4, stages, 2, 1)
    for k, guess in enumerate(simulate(schedule, time_model(), memory=memory).peak_memory_bytes):
        assert guess == pytest.approx(measured[k], rel=TOLERANCE), f"stage {k}"


def virtual_grid() -> list[MemoryRun]:
    """TeraPipe on 2 one-layer chunks per stage: slices, both orders, W actions, batch
    slices, whole sequences in groups (the 32-microbatch plans' shape, with and without
    Megatron's second warm-up term)."""
    def vplan(n: int, order: str = "1f1b", defer: bool = True, **kwargs) -> TeraPipePlan:
        return replace(plan(n, order, defer), virtual_stages=2, **kwargs)

    return [MemoryRun("v2 1f1b n4 M4 W0", vplan(4, defer=False), 4, 1),
            MemoryRun("v2 1f1b n4 M4 W1", vplan(4), 4, 1),
            MemoryRun("v2 gpipe n4 M2 W1", vplan(4, "gpipe"), 2, 1),
            MemoryRun("v2 1f1b n1 M5 groups of 3 W1", vplan(1, virtual_group=3), 5, 1),
            MemoryRun("v2 1f1b n1 M4 groups of 2 warm-up 0 W1",
                      vplan(1, virtual_group=2, virtual_warmup=0), 4, 1),
            MemoryRun("v2 1f1b n2 M4 b2 W1", vplan(2), 4, 2),
            # placed W actions hold their inputs until they run: every W at its stage's end
            # (the most held at once), and W places drawn at random
            MemoryRun("v2 1f1b n2 M4 W1 every W last", with_places(vplan(2), 4, 2, last=True), 4, 1),
            MemoryRun("v2 gpipe n4 M2 W1 random W places", with_places(vplan(4, "gpipe"), 2, 2), 2, 1),
            MemoryRun("v2 1f1b n4 M3 W1 random W places", with_places(vplan(4), 3, 2), 3, 1)]


def with_places(plan: TeraPipePlan, microbatches: int, stages: int, last: bool = False,
                seed: int = 7) -> TeraPipePlan:
    """`plan` with its W actions at the end of each stage's list (`last`), or each after a
    random number of F/B actions at or past its backward (non-decreasing)."""
    rng = random.Random(seed)
    places = []
    for actions in build_schedule(plan, microbatches, stages, 1).stages:
        compute, at = sum(a.kind != "W" for a in actions), 0
        stage = []
        for least in default_places(actions):
            at = compute if last else max(at, rng.randint(least, compute))
            stage.append(at)
        places.append(stage)
    return replace(plan, wgrad_after=places)


@pytest.mark.parametrize("recompute", [None, FullRecompute("uniform", 1)],
                         ids=["plain", "uniform1"])
def test_virtual_peaks_within_10_percent(recompute, profile):
    """TeraPipe on virtual stages (VirtualCells: 1/V of the stage's layers, K/V per chunk,
    W holds per chunk), also with Megatron's full recomputation."""
    stages, runs = 2, virtual_grid()
    cfg = model(stages)
    if recompute is not None:
        cfg = replace(cfg, recompute_granularity="full")
    memory = with_recompute(profile, recompute, cfg.hidden_size, dtype_bytes=4)
    measured = spawn(stages, "harness.measured.memory_runs:measure_virtual_peaks", cfg, 2, runs,
                     timeout=1200)
    errors = []
    for run in runs:
        for k, guess in enumerate(predicted(run, stages, memory)):
            actual = measured[k][run.name]
            if abs(guess / actual - 1.0) > TOLERANCE:
                errors.append(f"{run.name} stage {k}: predicted {guess:.0f} B, measured "
                              f"{actual:.0f} B ({100 * (guess / actual - 1.0):+.1f}%)")
    assert not errors, "\n".join(errors)


def test_the_plan_within_a_budget_measures_within_it(profile):
    stages = 2
    space = SearchSpace(SEQ, 2, stages, 4, "1f1b", 8, memory=profile, defer_wgrad=None)
    cost = time_model()
    free = search(cost, space)
    free_peak = max(free.chosen.result.peak_memory_bytes)
    budget = MemoryBudget(0.85 * free_peak)
    within = search_within_budget(cost, space, budget)
    assert max(within.chosen.result.peak_memory_bytes) <= budget.budget_bytes
    runs = [MemoryRun("free", free.plan, 4, 2), MemoryRun("within", within.plan, 4, 2)]
    measured = spawn(stages, "harness.measured.memory_runs:measure_run_peaks", model(stages), runs,
                     timeout=1200)
    assert max(m["free"] for m in measured) > budget.budget_bytes  # the budget binds
    assert all(m["within"] <= budget.budget_bytes for m in measured), (
        f"measured {[m['within'] for m in measured]} against a budget of {budget.budget_bytes:.0f}")
    assert np.isfinite(within.plan.predicted_time)
