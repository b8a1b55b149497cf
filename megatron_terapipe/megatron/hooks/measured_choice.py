"""MeasuredChoice: time a shortlist of schedules on the first training iterations and keep the
fastest measured.

Every candidate trains exactly (TeraPipe's schedules and Megatron's compute the same
gradients), so a trial costs only its iteration's time. The trials run in interleaved rounds:
one warm-up round (every candidate once, not counted: pools, graphs and caches are built
there), then `trials` rounds of every candidate once, every other one reversed (`alternating`).
An iteration's time is the forward-backward call's wall time, its maximum over all ranks, so
every rank keeps the same schedule. After the rounds an optional `replan` may offer one more
candidate (the planner on a cost model calibrated on the trials); it gets its own warm-up and
`trials` rounds beside the leader. Candidates whose medians are then within `runoff` (5%) of
the fastest, at most 3, run `2 x trials` more rounds among themselves: a few iterations cannot
tell apart schedules that close, and more rounds between the finalists are cheaper than more of
every candidate. Then the fastest median of all counted iterations wins, except that a TeraPipe
candidate must be measured more than `tie` faster than Megatron's schedule (ties go to
Megatron's). Evaluation calls (forward_only) run the kept schedule, Megatron's while the trials
last, untimed.

Rank 0 logs, in exactly these forms (scripts parse them):
    terapipe auto: trial <name>: <ms> ms measured, <ms> ms predicted
    terapipe auto: keeping <name> (<r>x <megatron name> measured)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from ...plan import TeraPipePlan
from .trial_timing import (broadcast_from_rank_zero, cuda_peak_memory, max_over_ranks, rank,
                           reset_cuda_peak, wall_clock)

#: A TeraPipe candidate must be measured more than this much faster than Megatron's schedule.
TIE = 0.01
#: Candidates this close to the fastest median after the rounds (at most RUNOFF_MOST) run more.
RUNOFF, RUNOFF_MOST = 0.05, 3
MEGATRON, TERAPIPE = "megatron", "terapipe"


@dataclass(frozen=True)
class TrialCandidate:
    """One schedule to try: Megatron's own (plan None) or TeraPipe with `plan`."""

    name: str  # as terapipe-plan's table names it: "Megatron 1F1B", "TeraPipe 1f1b", ...
    plan: Optional[TeraPipePlan] = None
    predicted_s: Optional[float] = None  # the simulator's iteration time
    schedule: Any = field(default=None, compare=False)  # the simulated action lists (calibration)

    @property
    def family(self) -> str:
        return MEGATRON if self.plan is None else TERAPIPE


@dataclass(frozen=True)
class MeasuredPick:
    """The kept candidate, each candidate's median seconds, and Megatron's for the ratio."""

    kept: TrialCandidate
    medians: Mapping[str, float]
    megatron: Optional[TrialCandidate]

    @property
    def speedup(self) -> Optional[float]:
        """Megatron's median over the kept one's (None without a Megatron candidate)."""
        if self.megatron is None:
            return None
        return self.medians[self.megatron.name] / self.medians[self.kept.name]


def choose_measured(candidates: Sequence[TrialCandidate], times: Mapping[str, Sequence[float]],
                    tie: float = TIE) -> MeasuredPick:
    """The fastest median of `times` (seconds per candidate name); a TeraPipe candidate only
    when it is more than `tie` faster than Megatron's schedule, and exact ties to Megatron's."""
    timed = [c for c in candidates if times.get(c.name)]
    if not timed:
        raise ValueError("no candidate was measured")
    medians = {c.name: float(statistics.median(times[c.name])) for c in timed}
    megatron = next((c for c in timed if c.family == MEGATRON), None)
    best = min(timed, key=lambda c: (medians[c.name], c.family != MEGATRON))
    if (megatron is not None and best is not megatron
            and medians[best.name] >= medians[megatron.name] * (1.0 - tie)):
        best = megatron
    return MeasuredPick(best, medians, megatron)


def runoff_finalists(candidates: Sequence[TrialCandidate], times: Mapping[str, Sequence[float]],
                     margin: float = RUNOFF, most: int = RUNOFF_MOST) -> list[TrialCandidate]:
    """The measured candidates whose median is within `margin` of the fastest, fastest first,
    at most `most` (one alone means there is nothing to run off)."""
    medians = {c.name: float(statistics.median(times[c.name])) for c in candidates
               if times.get(c.name)}
    if not medians:
        return []
    best = min(medians.values())
    close = [c for c in candidates if c.name in medians and medians[c.name] <= best * (1 + margin)]
    return sorted(close, key=lambda c: medians[c.name])[:most]


def alternating(items: Sequence[Any], rounds: int) -> list[Any]:
    """`rounds` rounds of `items`, every other one in reverse order: a candidate's mean place
    in the rounds is the same for all (over an even count), so a drift of the machine's speed
    across the trials (iterations still speeding up after the warm-up) favours none, and no
    candidate always follows the same one."""
    out: list[Any] = []
    for r in range(rounds):
        out += list(items) if r % 2 == 0 else list(items)[::-1]
    return out


def trial_rounds(count: int, trials: int, warmup: bool = True) -> list[tuple[int, bool]]:
    """(candidate index, counted) for each iteration: a warm-up round of every candidate
    (not counted), then `trials` alternating rounds of every candidate."""
    rounds = [(i, False) for i in range(count)] if warmup else []
    return rounds + [(i, True) for i in alternating(range(count), trials)]


def trial_iterations(count: int, trials: int) -> int:
    """Training iterations the first rounds of `count` candidates take."""
    return len(trial_rounds(count, trials))


#: (measured candidates with their median seconds) -> one more candidate, or None; runs on
#: rank 0 only (its answer is broadcast), and may log.
Replan = Callable[[Sequence[tuple[TrialCandidate, float]]], Optional[TrialCandidate]]


class MeasuredChoice:
    """Chooses among `candidates` by timing them (module docstring). `trials`: counted
    iterations per candidate (0: no trials, the predicted pick runs). `predicted`: the name of
    the candidate that runs without trials (default: the fastest predicted, ties to
    Megatron's). `runoff`: the margin for extra rounds between the closest (0: none).
    `iterations_left()`: the training iterations this run has left at its first call (None:
    unknown, assumed enough). `replan`: see Replan. `log`: rank 0's lines."""

    def __init__(self, candidates: Sequence[TrialCandidate], trials: int = 2, *,
                 predicted: Optional[str] = None, replan: Optional[Replan] = None,
                 iterations_left: Optional[Callable[[], Optional[int]]] = None,
                 log: Optional[Callable[[str], None]] = None, tie: float = TIE,
                 runoff: float = RUNOFF,
                 clock: Callable[[], float] = wall_clock,
                 reduce_max: Callable[[float], float] = max_over_ranks,
                 peak_memory: Optional[Callable[[], Optional[float]]] = None) -> None:
        self.candidates = _check_candidates(candidates, trials)
        self.trials, self.tie, self.replan, self.runoff = trials, tie, replan, runoff
        self.predicted = self._named(predicted) if predicted else _predicted_pick(
            self.candidates, tie)
        self.iterations_left = iterations_left or (lambda: None)
        self.log = log or (lambda line: print(line, flush=True))
        self.clock, self.reduce_max = clock, reduce_max
        self.peak_memory = peak_memory or cuda_peak_memory
        self.times: dict[str, list[float]] = {c.name: [] for c in self.candidates}
        self.peaks: dict[str, float] = {}  # each candidate's largest peak over its trials
        self.kept: Optional[TrialCandidate] = None if trials else self.predicted
        self.pick: Optional[MeasuredPick] = None
        self._queue: list[tuple[TrialCandidate, bool]] = []
        self._timed_in_phase: dict[str, TrialCandidate] = {}  # logged when the phase ends
        self._started = self._replanned = self._ran_off = False
        self.last_run: Optional[str] = None  # the candidate of the last training iteration
        self._left: Optional[int] = None  # training iterations left at the first call
        self._done = 0  # training iterations tried so far

    def _named(self, name: str) -> TrialCandidate:
        for c in self.candidates:
            if c.name == name:
                return c
        raise ValueError(f"MeasuredChoice: predicted={name!r} is none of the candidates "
                         f"({', '.join(c.name for c in self.candidates)})")

    # -- the schedule Megatron calls ---------------------------------------------------------
    def wrap(self, megatron_schedule: Callable, terapipe_schedule: Optional[Callable] = None
             ) -> Callable:
        """A function with the signature of Megatron's schedules that runs this iteration's
        candidate: Megatron's through `megatron_schedule`, TeraPipe's through
        `terapipe_schedule` (default: forward_backward_terapipe) with the candidate's plan."""
        if terapipe_schedule is None:
            from .forward_backward import forward_backward_terapipe as terapipe_schedule

        def run(candidate: TrialCandidate, kwargs: dict):
            if candidate.plan is None:
                return megatron_schedule(**kwargs)
            return terapipe_schedule(**kwargs, plan=candidate.plan)

        def forward_backward(**kwargs):
            if kwargs.get("forward_only", False):
                return run(self.kept or self._megatron_or_first(), kwargs)
            candidate, counted = self._next()
            if candidate is None:
                assert self.kept is not None
                self.last_run = self.kept.name
                return run(self.kept, kwargs)
            self.last_run = candidate.name
            return self._trial(candidate, counted, lambda: run(candidate, kwargs))

        forward_backward.measured_choice = self  # type: ignore[attr-defined]
        return forward_backward

    def _megatron_or_first(self) -> TrialCandidate:
        return next((c for c in self.candidates if c.family == MEGATRON), self.candidates[0])

    def _next(self) -> tuple[Optional[TrialCandidate], bool]:
        """This training iteration's candidate and whether it counts (None: decided)."""
        if self.kept is not None:
            return None, False
        if not self._started:
            self._started = True
            self._left = self.iterations_left()
            if not self._enough_iterations(trial_iterations(len(self.candidates), self.trials)):
                return None, False
            self._queue = [(self.candidates[i], counted) for i, counted in
                           trial_rounds(len(self.candidates), self.trials)]
        return self._queue.pop(0)

    def _enough_iterations(self, needed: int) -> bool:
        left = self._left
        if left is None or left >= needed:
            return True
        self.kept = self.predicted
        self._say(f"terapipe auto: {left} training iterations are fewer than the {needed} the "
                  f"trials need ({len(self.candidates)} candidates x ({self.trials} trials + "
                  f"warm-up)): keeping the predicted pick {self.predicted.name}")
        return False

    def _trial(self, candidate: TrialCandidate, counted: bool, call: Callable[[], Any]) -> Any:
        """Run and time one iteration of `candidate`; an error names it."""
        reset_cuda_peak()
        start = self.clock()
        try:
            result = call()
        except Exception as exc:
            raise RuntimeError(f"terapipe auto: trial {candidate.name} failed ({type(exc).__name__}"
                               f": {exc}); run it alone to see why, or drop "
                               "--pipeline-schedule auto") from exc
        seconds = self.reduce_max(self.clock() - start)
        self._done += 1
        if counted:
            self.times[candidate.name].append(seconds)
            self._timed_in_phase.setdefault(candidate.name, candidate)
            peak = self.peak_memory()
            if peak is not None:
                self.peaks[candidate.name] = max(peak, self.peaks.get(candidate.name, 0.0))
        if not self._queue:  # the rounds are over: every rank decides in this same iteration
            for timed in self._timed_in_phase.values():  # in the order the phase began them
                self._log_trial(timed)
            self._timed_in_phase = {}
            self._finish_rounds()
        return result

    def _log_trial(self, candidate: TrialCandidate) -> None:
        measured = statistics.median(self.times[candidate.name])
        predicted = ("no" if candidate.predicted_s is None
                     else f"{candidate.predicted_s * 1e3:.1f} ms")
        self._say(f"terapipe auto: trial {candidate.name}: {measured * 1e3:.1f} ms measured, "
                  f"{predicted} predicted")
        if candidate.name in self.peaks:
            self._say(f"terapipe auto: trial {candidate.name}: peak "
                      f"{self.peaks[candidate.name] / 2**30:.2f} GiB allocated")

    def _finish_rounds(self) -> None:
        """After the rounds: one more candidate from `replan` (once), then a runoff between the
        closest (once), then the choice."""
        if self.replan is not None and not self._replanned:
            self._replanned = True
            extra = self._replanned_candidate()
            if extra is not None:
                leader = choose_measured(self.candidates, self.times, self.tie).kept
                self.candidates = (*self.candidates, extra)
                self.times[extra.name] = []
                if self._enough_iterations_for_extra(extra):
                    self._queue = [(extra, False)] + [(c, True) for c in
                                                      alternating((extra, leader), self.trials)]
                    return
        if not self._ran_off:
            self._ran_off = True
            if self._queue_runoff():
                return
        self._decide()

    def _queue_runoff(self) -> bool:
        """Queue 2 x trials more rounds of the finalists; False when there is no runoff."""
        finalists = runoff_finalists(self.candidates, self.times, self.runoff)
        if len(finalists) < 2 or not self.trials:
            return False
        rounds = 2 * self.trials
        names = ", ".join(c.name for c in finalists)
        left = None if self._left is None else self._left - self._done
        if left is not None and left < rounds * len(finalists):
            self._say(f"terapipe auto: {left} training iterations left, fewer than the "
                      f"{rounds * len(finalists)} a runoff between {names} needs: choosing "
                      "among the trials so far")
            return False
        self._say(f"terapipe auto: runoff between {names} (within {self.runoff:.0%} of the "
                  f"fastest): {rounds} more rounds")
        self._queue = [(c, True) for c in alternating(finalists, rounds)]
        return True

    def _replanned_candidate(self) -> Optional[TrialCandidate]:
        measured = [(c, statistics.median(self.times[c.name])) for c in self.candidates
                    if self.times[c.name]]
        extra = self.replan(measured) if rank() == 0 else None
        extra = broadcast_from_rank_zero(extra)
        if extra is None or any(c.name == extra.name or _same_plan(c.plan, extra.plan)
                                for c in self.candidates):
            return None
        return extra

    def _enough_iterations_for_extra(self, extra: TrialCandidate) -> bool:
        needed = 1 + 2 * self.trials
        left = None if self._left is None else self._left - self._done
        if left is None or left >= needed:
            return True
        self._say(f"terapipe auto: {left} training iterations left, fewer than the {needed} "
                  f"that trying {extra.name} needs: choosing among the trials so far")
        return False

    def _decide(self) -> None:
        self.pick = choose_measured(self.candidates, self.times, self.tie)
        self.kept = self.pick.kept
        ratio = self.pick.speedup
        against = (f"{ratio:.2f}x {self.pick.megatron.name} measured"
                   if ratio is not None and self.pick.megatron is not None
                   else "no Megatron schedule among the trials")
        self._say(f"terapipe auto: keeping {self.kept.name} ({against})")

    def _say(self, line: str) -> None:
        if rank() == 0:
            self.log(line)


def _same_plan(a: Optional[TeraPipePlan], b: Optional[TeraPipePlan]) -> bool:
    """The same schedule, whatever each predicted of it (Megatron's is the same as Megatron's)."""
    if a is None or b is None:
        return a is b
    return replace(a, predicted_time=None) == replace(b, predicted_time=None)


def _check_candidates(candidates: Sequence[TrialCandidate], trials: int
                      ) -> tuple[TrialCandidate, ...]:
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
        raise ValueError(f"MeasuredChoice: trials must be a whole number >= 0, got {trials!r}")
    out = tuple(candidates)
    if not out:
        raise ValueError("MeasuredChoice: give at least one candidate")
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise ValueError(f"MeasuredChoice: candidate names must differ, got {names}")
    return out


def _predicted_pick(candidates: Sequence[TrialCandidate], tie: float) -> TrialCandidate:
    """The fastest predicted (Megatron's where a TeraPipe one is not `tie` faster); the first
    when nothing is predicted."""
    predicted = {c.name: [c.predicted_s] for c in candidates if c.predicted_s is not None}
    if not predicted:
        return candidates[0]
    return choose_measured(candidates, predicted, tie).kept
