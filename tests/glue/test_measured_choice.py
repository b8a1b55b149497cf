"""MeasuredChoice (hooks/measured_choice.py): --pipeline-schedule auto's trials.

Fake schedules advance a fake clock by a planted time per candidate, so the rule is checked
exactly: the fastest median wins, ties (within TIE) go to Megatron's schedule, warm-up rounds
do not count, evaluation calls are not timed, a run too short for the trials keeps the
predicted pick and says so, a failing trial stops the run naming the candidate, and a
re-planned candidate is tried beside the leader. On 2 gloo processes whose clocks disagree,
every rank keeps the same candidate: the one fastest by the maximum over ranks. Exactness
through the switches between schedules is checked with every gradient in
test_distributed_optimizer.py (its "switch" case)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from harness import spawn
from megatron_terapipe import MeasuredChoice, TeraPipePlan, TrialCandidate
from megatron_terapipe.megatron.hooks.measured_choice import (RUNOFF, TIE, alternating,
                                                              choose_measured, runoff_finalists,
                                                              trial_iterations, trial_rounds)

MEGATRON = TrialCandidate("Megatron 1F1B", None, predicted_s=0.010)
FOUR = TrialCandidate("TeraPipe 1f1b", TeraPipePlan([16, 16, 16, 16]), predicted_s=0.008)
TWO = TrialCandidate("TeraPipe gpipe", TeraPipePlan([32, 32], order="gpipe"), predicted_s=0.009)

TRIAL_LINE = re.compile(r"^terapipe auto: trial (.+): ([0-9.]+) ms measured, ([0-9.]+) ms predicted$")
KEEP_LINE = re.compile(r"^terapipe auto: keeping (.+) \(([0-9.]+)x (.+) measured\)$")


class Fake:
    """Schedules that advance a clock by each candidate's planted seconds (the first call of
    each by `warmup_s` more), recording what ran."""

    def __init__(self, seconds: dict[str, float], warmup_s: float = 0.0, fail: str = "",
                 jitter: dict[str, list[float]] | None = None, drift_s: float = 0.0):
        self.seconds, self.warmup_s, self.fail, self.drift_s = seconds, warmup_s, fail, drift_s
        self.jitter = {k: list(v) for k, v in (jitter or {}).items()}  # more seconds, per call
        self.now, self.ran, self.lines = 0.0, [], []

    def clock(self) -> float:
        return self.now

    def _run(self, name: str, forward_only: bool) -> list:
        if name == self.fail:
            raise ValueError("planted failure")
        self.ran.append((name, forward_only))
        self.now += self.seconds[name] + (self.warmup_s if self.ran.count((name, False)) == 1
                                          and not forward_only else 0.0)
        if self.jitter.get(name):
            self.now += self.jitter[name].pop(0)
        if not forward_only:  # the machine gets faster by drift_s an iteration
            self.now -= self.drift_s * (len(self.ran) - 1)
        return [name]

    def megatron(self, **kwargs):
        return self._run(MEGATRON.name, kwargs.get("forward_only", False))

    def terapipe(self, plan, **kwargs):
        name = next(n for n, c in CANDIDATES.items() if c.plan == plan)
        return self._run(name, kwargs.get("forward_only", False))

    def choice(self, candidates, trials=2, **kwargs) -> tuple[MeasuredChoice, object]:
        choice = MeasuredChoice(candidates, trials, clock=self.clock, log=self.lines.append,
                                reduce_max=lambda s: s, peak_memory=lambda: None, **kwargs)
        return choice, choice.wrap(self.megatron, self.terapipe)


CANDIDATES = {c.name: c for c in (MEGATRON, FOUR, TWO)}
CANDIDATES["TeraPipe 1f1b, calibrated"] = TrialCandidate(
    "TeraPipe 1f1b, calibrated", TeraPipePlan([24, 24, 16]), predicted_s=0.007)


def train(forward_backward, iterations: int) -> None:
    for _ in range(iterations):
        forward_backward(forward_only=False)


def test_rounds_alternate_after_one_uncounted_warm_up():
    assert trial_rounds(3, 2) == [(0, False), (1, False), (2, False), (0, True), (1, True),
                                  (2, True), (2, True), (1, True), (0, True)]
    assert trial_iterations(3, 2) == 9 and trial_iterations(4, 0) == 4
    assert alternating("abc", 3) == list("abccbaabc")
    places = {c: [i for i, x in enumerate(alternating("abcde", 4)) if x == c] for c in "abcde"}
    assert len({sum(p) for p in places.values()}) == 1  # the same mean place for every one


def test_a_machine_speeding_up_through_the_trials_favours_no_candidate():
    """Each iteration runs 0.3 ms faster than the one before: over rounds in one order, the
    later candidates would gain up to 0.6 ms each round, and FOUR (0.5 ms slower than TWO,
    and after it) would be kept. Alternating rounds take the same off every candidate."""
    fake = Fake({MEGATRON.name: 0.020, TWO.name: 0.0100, FOUR.name: 0.0105}, drift_s=0.0003)
    choice, forward_backward = fake.choice([MEGATRON, TWO, FOUR], runoff=0.0)
    train(forward_backward, 9 + 1)
    medians = choice.pick.medians
    assert choice.kept == TWO
    assert medians[FOUR.name] - medians[TWO.name] == pytest.approx(0.0005)
    assert medians[MEGATRON.name] - medians[TWO.name] == pytest.approx(0.0100)


def test_the_fastest_measured_wins_and_every_rank_logs_in_the_documented_form():
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: 0.012, TWO.name: 0.008}, warmup_s=1.0)
    choice, forward_backward = fake.choice([MEGATRON, FOUR, TWO])
    train(forward_backward, 9 + 3)
    # the prediction said FOUR; the warm-ups (1 s each) did not count
    assert choice.kept == TWO and [n for n, _ in fake.ran[-3:]] == [TWO.name] * 3
    assert [n for n, _ in fake.ran[:3]] == [MEGATRON.name, FOUR.name, TWO.name]
    trials = [TRIAL_LINE.match(line) for line in fake.lines[:3]]
    assert all(trials), fake.lines
    assert [(m[1], float(m[2]), float(m[3])) for m in trials] == [
        (MEGATRON.name, 10.0, 10.0), (FOUR.name, 12.0, 8.0), (TWO.name, 8.0, 9.0)]
    keep = KEEP_LINE.match(fake.lines[3])
    assert keep and (keep[1], float(keep[2]), keep[3]) == (TWO.name, 1.25, MEGATRON.name)
    assert choice.pick.medians == pytest.approx({MEGATRON.name: 0.010, FOUR.name: 0.012,
                                                 TWO.name: 0.008})


@pytest.mark.parametrize("terapipe_s", [0.010, 0.010 * (1 - TIE / 2)])
def test_ties_go_to_megatrons_schedule(terapipe_s):
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: terapipe_s})
    choice, forward_backward = fake.choice([FOUR, MEGATRON])  # Megatron's second: no matter
    train(forward_backward, 6 + 8 + 1)  # the rounds, a runoff of 4 rounds, then the kept one
    assert choice.kept == MEGATRON and fake.ran[-1][0] == MEGATRON.name
    assert fake.lines[-1] == f"terapipe auto: keeping {MEGATRON.name} (1.00x {MEGATRON.name} measured)"


def test_runoff_finalists_are_the_closest_to_the_fastest_at_most_three():
    five = [TrialCandidate(f"TeraPipe {i}", TeraPipePlan([64 - 8 * i, 8 * i] if i else [64]))
            for i in range(5)]
    times = {"TeraPipe 0": [1.00], "TeraPipe 1": [1.035], "TeraPipe 2": [0.99],
             "TeraPipe 3": [1.02], "TeraPipe 4": [1.06]}
    assert [c.name for c in runoff_finalists(five, times)] == ["TeraPipe 2", "TeraPipe 0",
                                                               "TeraPipe 3"]
    assert [c.name for c in runoff_finalists(five, times, most=5)] == [
        "TeraPipe 2", "TeraPipe 0", "TeraPipe 3", "TeraPipe 1"]  # 1.06 > 0.99 x 1.05
    assert runoff_finalists(five, {}) == []


def test_a_close_race_is_run_off_and_decided_on_every_counted_iteration():
    """FOUR and TWO are 2% apart; their first rounds (on a planted noisy clock) put FOUR
    ahead, the runoff's 4 more rounds each bring the medians to the truth: TWO."""
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: 0.0060, TWO.name: 0.0059},
                jitter={TWO.name: [0.0, 0.0002, 0.0002]})  # its two counted rounds run slow
    choice, forward_backward = fake.choice([MEGATRON, FOUR, TWO])
    train(forward_backward, 9 + 8 + 1)
    assert fake.lines[3] == (f"terapipe auto: runoff between {FOUR.name}, {TWO.name} (within "
                             f"{RUNOFF:.0%} of the fastest): 4 more rounds")
    assert [n for n, _ in fake.ran[9:17]] == [FOUR.name, TWO.name, TWO.name, FOUR.name] * 2
    assert len(choice.times[TWO.name]) == 6 and len(choice.times[MEGATRON.name]) == 2
    assert choice.kept == TWO and fake.ran[-1][0] == TWO.name


def test_a_runoff_the_run_has_no_iterations_for_is_skipped_and_said():
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: 0.0060, TWO.name: 0.0059})
    choice, forward_backward = fake.choice([MEGATRON, FOUR, TWO], iterations_left=lambda: 16)
    train(forward_backward, 12)
    assert choice.kept == TWO and fake.lines[3] == (
        f"terapipe auto: 7 training iterations left, fewer than the 8 a runoff between "
        f"{TWO.name}, {FOUR.name} needs: choosing among the trials so far")


def test_choose_measured_takes_medians():
    times = {MEGATRON.name: [0.010, 0.010, 0.010], FOUR.name: [0.005, 0.009, 0.050]}
    pick = choose_measured([MEGATRON, FOUR], times)
    assert pick.kept == FOUR and pick.speedup == pytest.approx(10 / 9)
    with pytest.raises(ValueError, match="no candidate was measured"):
        choose_measured([MEGATRON], {})


def test_evaluation_is_untimed_and_runs_megatrons_schedule_during_the_trials():
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: 0.005})
    choice, forward_backward = fake.choice([MEGATRON, FOUR], trials=1)
    forward_backward(forward_only=False)
    forward_backward(forward_only=True)
    assert fake.ran == [(MEGATRON.name, False), (MEGATRON.name, True)]
    train(forward_backward, 3)
    assert choice.kept == FOUR and choice.times[MEGATRON.name] == [pytest.approx(0.010)]
    forward_backward(forward_only=True)
    assert fake.ran[-1] == (FOUR.name, True)


def test_a_run_too_short_for_the_trials_keeps_the_predicted_pick_and_says_so():
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: 0.005, TWO.name: 0.001})
    choice, forward_backward = fake.choice([MEGATRON, FOUR, TWO], iterations_left=lambda: 8)
    train(forward_backward, 8)
    assert choice.kept == FOUR and {n for n, _ in fake.ran} == {FOUR.name}  # predicted fastest
    assert fake.lines == ["terapipe auto: 8 training iterations are fewer than the 9 the trials "
                          "need (3 candidates x (2 trials + warm-up)): keeping the predicted pick "
                          "TeraPipe 1f1b"]


def test_zero_trials_run_the_predicted_pick_from_the_first_iteration():
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: 0.005})
    choice, forward_backward = fake.choice([MEGATRON, FOUR], trials=0, predicted=MEGATRON.name)
    train(forward_backward, 3)
    assert choice.kept == MEGATRON and fake.ran == [(MEGATRON.name, False)] * 3 and not fake.lines


def test_a_failing_trial_stops_the_run_naming_the_candidate():
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: 0.005}, fail=FOUR.name)
    _, forward_backward = fake.choice([MEGATRON, FOUR])
    forward_backward(forward_only=False)
    with pytest.raises(RuntimeError, match=r"^terapipe auto: trial TeraPipe 1f1b failed "
                                           r"\(ValueError: planted failure\)"):
        forward_backward(forward_only=False)


def test_a_replanned_candidate_is_tried_beside_the_leader():
    calibrated = CANDIDATES["TeraPipe 1f1b, calibrated"]
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: 0.008, calibrated.name: 0.006})
    asked = []

    def replan(measured):
        asked.append([(c.name, round(s, 6)) for c, s in measured])
        return calibrated

    choice, forward_backward = fake.choice([MEGATRON, FOUR], replan=replan)
    train(forward_backward, 6 + 5 + 1)
    assert asked == [[(MEGATRON.name, 0.010), (FOUR.name, 0.008)]]
    assert [n for n, _ in fake.ran[6:11]] == [calibrated.name, calibrated.name, FOUR.name,
                                              FOUR.name, calibrated.name]
    assert choice.kept == calibrated and fake.ran[-1][0] == calibrated.name
    assert fake.lines[-1] == (f"terapipe auto: keeping {calibrated.name} (1.67x {MEGATRON.name} "
                              "measured)")


@pytest.mark.parametrize("predicted_time", [None, 0.5])
def test_a_replanned_plan_already_tried_is_not_tried_again(predicted_time):
    """Whatever the calibrated model predicts of it, a plan already tried is not a new one."""
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: 0.008})
    plan = FOUR.plan if predicted_time is None else replace(FOUR.plan, predicted_time=0.5)
    again = TrialCandidate("TeraPipe 1f1b, calibrated", plan)
    choice, forward_backward = fake.choice([MEGATRON, FOUR], replan=lambda measured: again)
    train(forward_backward, 7)
    assert choice.kept == FOUR and len(fake.ran) == 7


@pytest.mark.parametrize("trials", [-1, 1.5, True])
def test_bad_trials_and_candidates_are_refused(trials):
    with pytest.raises(ValueError, match="trials must be a whole number >= 0"):
        MeasuredChoice([MEGATRON], trials)
    with pytest.raises(ValueError, match="candidate names must differ"):
        MeasuredChoice([MEGATRON, MEGATRON])
    with pytest.raises(ValueError, match="predicted='nope' is none of the candidates"):
        MeasuredChoice([MEGATRON], predicted="nope")


def test_every_rank_keeps_the_same_candidate_by_the_slowest_rank():
    """Rank 0 measures TeraPipe faster, rank 1 much slower: by the maximum over ranks
    Megatron's schedule is faster, and both ranks keep it."""
    kept = spawn(2, "harness.runs.workers:measured_choice_by_rank")
    assert kept == [("Megatron 1F1B", 0.012), ("Megatron 1F1B", 0.012)]


def test_each_trial_logs_the_largest_peak_of_its_own_iterations():
    """The peak is read after every counted iteration and kept per candidate, so the lines
    (written when the rounds end) give each candidate's own peak, not the last iteration's."""
    fake = Fake({MEGATRON.name: 0.010, FOUR.name: 0.012, TWO.name: 0.008})
    choice = MeasuredChoice([MEGATRON, FOUR, TWO], 2, clock=fake.clock, log=fake.lines.append,
                            reduce_max=lambda s: s, peak_memory=lambda: 2.0**30 * len(fake.ran),
                            runoff=0.0)
    train(choice.wrap(fake.megatron, fake.terapipe), 9)
    peaks = [line for line in fake.lines if "peak" in line]
    # counted iterations 4-9 in the order M, FOUR, TWO, TWO, FOUR, M
    assert peaks == [f"terapipe auto: trial {MEGATRON.name}: peak 9.00 GiB allocated",
                     f"terapipe auto: trial {FOUR.name}: peak 8.00 GiB allocated",
                     f"terapipe auto: trial {TWO.name}: peak 7.00 GiB allocated"]
