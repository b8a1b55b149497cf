"""ArgsPlanProvider: the plan source Megatron-LM runs get from their flags.

The schedule asks it for a plan the first time it runs a (seq_length, micro_batch_size); every
rank asks at the same time. Rank 0 chooses the plan (plans_from_flags.py, which calls the planner's
search) and broadcasts it, so every rank runs the identical plan. With a measured profile every
rank measures at once (tensor-parallel layers need all their ranks, and nobody waits in a
collective while others measure); rank 0 fits and caches it (profile_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

from ...plan import TeraPipePlan
from ...planner.profile.time_fit import LayerTimeFit
from ..platform import compat
from .startup_log import PlanReport
from .inputs_from_flags import planner_inputs
from .plans_from_flags import plan_run, wants_profile, write_simulated_trace
from .profile_cache import (default_measure, device_name, fit_measurements, is_cached,
                            profile_cache_path, profile_cells, save_profile)
from .settings import RunSettings, TeraPipeArgumentError

T = TypeVar("T")


@dataclass(frozen=True)
class Failure:
    """An error on one rank, sent to the others so that every rank raises it: the planner's
    own (a ValueError: what the flags ask cannot run) as a flag error; any other as itself on
    the rank that raised it, with its traceback, and by its name on the others."""

    message: str
    flags: bool = True  # the planner's own: TeraPipeArgumentError on every rank
    error: Optional[BaseException] = field(default=None, compare=False)  # this rank's own

    def __reduce__(self):  # other ranks get the text: an exception need not unpickle
        return Failure, (self.message, self.flags)


@dataclass(frozen=True)
class CacheLookup:
    """Rank 0's answer to: is this shape's profile cached? (broadcast to every rank)"""

    path: str
    cached: bool


def _look_up(run: RunSettings) -> CacheLookup:
    path = profile_cache_path(run)
    return CacheLookup(str(path), is_cached(path))


@dataclass(frozen=True)
class ChosenPlan:
    """What rank 0 broadcasts: the plan (as its dict) and its report."""

    plan: dict
    report: PlanReport


@dataclass
class ArgsPlanProvider:
    """Plans from the parsed flags, one per (seq_length, micro_batch_size), computed once.

    `plan_for` is called by the schedule on every rank at the same time (all ranks run it).
    `measure(settings, cells)` returns LayerMeasurements (tests pass their own).
    """

    settings: RunSettings
    plans: dict[tuple[int, int], TeraPipePlan] = field(default_factory=dict)
    reports: dict[tuple[int, int], PlanReport] = field(default_factory=dict)
    measure: Optional[Callable] = None
    log: bool = True
    measurements: int = 0  # layer profiles measured by this process
    cache_hits: int = 0

    @classmethod
    def from_args(cls, args, **kwargs) -> "ArgsPlanProvider":
        """The provider for Megatron-LM's parsed args (RunSettings.from_args)."""
        return cls(RunSettings.from_args(args), **kwargs)

    def plan_for(self, seq_length: int, micro_batch_size: int) -> TeraPipePlan:
        key = (int(seq_length), int(micro_batch_size))
        if key not in self.plans:
            self.plans[key] = self._choose(self.settings.for_batch(*key))
        return self.plans[key]

    # -- the collective protocol: every rank runs exactly these steps ------------------------
    def _choose(self, run: RunSettings) -> TeraPipePlan:
        fit = self._profile(run) if wants_profile(run.terapipe) else None
        chosen = None
        if _rank() == 0:
            chosen = _guard(lambda: self._plan_on_rank_zero(run, fit))
        chosen = _unwrap(_broadcast(chosen))
        plan = TeraPipePlan.from_dict(chosen.plan)
        self.reports[(run.shape.seq_length, run.shape.micro_batch_size)] = chosen.report
        if _rank() == 0 and self.log:
            for line in chosen.report.lines(plan):
                print(line, flush=True)
        return plan

    def _profile(self, run: RunSettings) -> Optional[LayerTimeFit]:
        """The measured fit, when this start measures one (every rank does); None when rank 0
        finds it in the cache."""
        lookup = None
        if _rank() == 0:
            lookup = _guard(lambda: _look_up(run))
        lookup = _unwrap(_broadcast(lookup))
        if lookup.cached:
            self.cache_hits += 1
            return None
        outcome = _guard(lambda: self._measure(run))
        failures = [o for o in _all_gather(outcome if isinstance(outcome, Failure) else None) if o]
        if failures:  # this rank's own first: raised with its traceback
            _unwrap(outcome if isinstance(outcome, Failure) else failures[0])
        if _rank() == 0:
            save_profile(outcome, Path(lookup.path))
        return outcome

    def _measure(self, run: RunSettings) -> LayerTimeFit:
        cells = profile_cells(run)
        if _rank() == 0 and self.log:
            print(f"> terapipe: measuring one layer on {device_name()} ({len(cells)} cells, "
                  "once; cached for later starts)", flush=True)
        measure = self.measure or (lambda r, c: default_measure(r, c, progress=_rank() == 0))
        measurements = _with_rng_kept(lambda: measure(run, cells))
        self.measurements += 1
        return fit_measurements(run, measurements)

    def _plan_on_rank_zero(self, run: RunSettings, fit: Optional[LayerTimeFit]) -> ChosenPlan:
        """The plan (from the measured `fit` when there is one) and its report; with
        --terapipe-trace, the simulated timeline next to the measured one."""
        planned = plan_run(run, inputs=lambda: planner_inputs(run, fit))
        trace = run.terapipe.trace
        if trace and planned.inputs is not None:
            try:
                write_simulated_trace(planned, trace)
            except OSError as exc:  # a trace is a by-product: training goes on without it
                planned.report.notes.append(f"could not write the simulated trace: {exc}")
        return ChosenPlan(planned.plan.to_dict(), planned.report)


def _guard(fn: Callable[[], T]) -> Union[T, Failure]:
    """Run `fn`; an error becomes a Failure so that every rank can raise it (`_unwrap`)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - every rank must learn of rank 0's failure
        if isinstance(exc, TeraPipeArgumentError):
            return Failure(str(exc))
        return Failure(f"{type(exc).__name__}: {exc}", isinstance(exc, ValueError), exc)


def _unwrap(value: Union[T, Failure]) -> T:
    """`value`, or its error raised: the planner's own as TeraPipeArgumentError; another as
    itself where it was raised, and elsewhere as a RuntimeError naming it."""
    if not isinstance(value, Failure):
        return value
    if value.flags:
        raise TeraPipeArgumentError(value.message)
    if value.error is not None:
        raise value.error
    raise RuntimeError(f"terapipe: planning failed on another rank with {value.message} (its "
                       "traceback is in that rank's output)")


def _distributed():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _distributed()
    return dist.get_rank() if dist is not None else 0


def _broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (identity without torch.distributed)."""
    dist = _distributed()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj: Any) -> list[Any]:
    dist = _distributed()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _with_rng_kept(fn: Callable[[], T]) -> T:
    """Run `fn` (which builds and runs a layer) without moving this rank's random streams:
    torch's CPU and CUDA generators and Megatron's model-parallel RNG tracker come back as they
    were (the measurement seeds and replaces the tracker)."""
    import torch

    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    saved_tracker = compat.save_rng_tracker()  # private globals of tensor_parallel.random
    try:
        return fn()
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        compat.restore_rng_tracker(saved_tracker)
