"""--pipeline-schedule auto that measures: the layout (model chunks per stage) is chosen at
start-up from the prediction (auto_schedule.py), since it decides how the model is built;
within it, a MeasuredChoice (hooks/measured_choice.py) times a shortlist on the first training
iterations and keeps the fastest measured. The shortlist, at most SHORTLIST:
- Megatron's own schedule for the layout (1F1B, or interleaved on chunks), always;
- TeraPipe's predicted best plan per order;
- the best uniform slicing (on chunks: uniform slices as many as the best plan's); where that
  is the best plan itself, a uniform slicing at the far end of what slicing can gain
  (_other_uniform);
- the best plan with its W placement switched (placed / default places);
- after the rounds, the plan the search makes on a cost model calibrated on the trials
  (planner/evaluate/calibration.py), when it differs from all of them.
Only plans predicted to fit --terapipe-memory-budget are tried. The calibration is saved beside
the profile cache (calibration_path), so the next start of the same shape plans with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from ...plan import TeraPipePlan
from ...planner.evaluate.calibration import (CalibratedCostModel, Calibration, Trial,
                                             fit_calibration)
from ...planner.inputs import PlannerInputs
from ...planner.schedule_choice import (MEGATRON, TERAPIPE, ScheduleOption, ScheduleTable,
                                         terapipe_row_name)
from ...planner.wgrad_slots import place_wgrad, stage_limits
from ...schedule import build_schedule
from ..hooks.measured_choice import MeasuredChoice, TrialCandidate
from ..platform import compat
from .profile_cache import cache_dir, device_name
from .settings import RunSettings

#: Candidates timed in the first rounds (the re-planned one comes after them).
SHORTLIST = 5


@dataclass(frozen=True)
class Layout:
    """What auto fixes at start-up: model chunks per stage, and TeraPipe's order for the flags."""

    chunks: int
    order: str
    placement: str = "ring"  # ring or v (2 chunks)


def shortlist(inputs: PlannerInputs, table: ScheduleTable, chunks: int,
              placement: str = "ring") -> list[TrialCandidate]:
    """The candidates within `chunks` model chunks per stage placed round the ring or in a V
    (module docstring), Megatron's schedule first (none in a V), then TeraPipe's by predicted
    time."""
    megatron = next((o for o in table.options if o.family == MEGATRON
                     and o.num_chunks == chunks and o.runnable and placement == "ring"), None)
    terapipe = [o for o in table.options if o.family == TERAPIPE and o.num_chunks == chunks
                and o.fits and o.plan is not None and o.plan.virtual_placement == placement]
    out = [] if megatron is None else [_candidate(megatron.name, None, megatron)]
    out += [_candidate(o.name, o.plan, o) for o in terapipe]
    if terapipe:
        best = terapipe[0]
        out += [c for c in (_uniform(inputs, best), _w_switched(inputs, best)) if c is not None]
    return _distinct(out)[:SHORTLIST]


def _candidate(name: str, plan: Optional[TeraPipePlan], option: ScheduleOption
               ) -> TrialCandidate:
    assert option.result is not None
    return TrialCandidate(name, plan, option.time, option.result.schedule)


def _simulated(inputs: PlannerInputs, name: str, plan: TeraPipePlan) -> Optional[TrialCandidate]:
    """`plan` as a candidate with its prediction; None when it does not fit the budget."""
    result = inputs.space.simulate(plan, inputs.cost_model)
    if not inputs.budget.fits(result.peak_memory_bytes):
        return None
    return TrialCandidate(name, replace(plan, predicted_time=result.iteration_time),
                          result.iteration_time, result.schedule)


def _uniform(inputs: PlannerInputs, best: ScheduleOption) -> Optional[TrialCandidate]:
    """The best uniform slicing in the best plan's order (the search's own uniform start; on
    model chunks, uniform slices as many as the best plan's)."""
    plan = best.plan
    assert plan is not None
    try:
        if best.num_chunks == 1:
            uniform = inputs.search(plan.order).starts[1].plan
        else:
            space = inputs.space
            uniform = replace(plan, seq_slices=list(TeraPipePlan.uniform(
                space.seq_length, len(plan.seq_slices), plan.order, space.unit).seq_slices),
                wgrad_after=())
        if uniform.seq_slices == plan.seq_slices:
            return _other_uniform(inputs, best)
        return _simulated(inputs, f"{best.name}, uniform {len(uniform.seq_slices)} slices",
                          replace(uniform, virtual_stages=plan.virtual_stages))
    except ValueError:  # over the budget, or batch slices a uniform cut cannot keep
        return None


#: The most slices _other_uniform tries.
OTHER_UNIFORM_MOST = 16
#: The share of the iteration the far-end slicing leaves to the fill-and-drain bubble.
FAR_BUBBLE = 0.1


def _other_uniform(inputs: PlannerInputs, best: ScheduleOption) -> Optional[TrialCandidate]:
    """Where the best uniform slicing is the best plan itself: a uniform slicing of another
    count, since trials of one slicing alone cannot show whether slicing pays on this machine,
    nor tell the calibration a per-cell overhead from a scale. The count that leaves at most
    FAR_BUBBLE of the iteration to the pipeline's fill and drain (S - 1 of M x K x chunks +
    S - 1 cells), the far end of what slicing can gain, so that the trials bracket the best
    slicing; where that is the best plan's own count, the other count predicted fastest."""
    plan, space = best.plan, inputs.space
    assert plan is not None
    most = min(OTHER_UNIFORM_MOST, space.seq_length // space.unit)
    cells = (space.num_stages - 1) * (1 - FAR_BUBBLE) / FAR_BUBBLE
    far = min(most, max(1, math.ceil(cells / (space.num_microbatches * best.num_chunks))))
    counts = [far] if far != len(plan.seq_slices) else [
        c for c in range(1, most + 1) if c != len(plan.seq_slices)]
    found = []
    for count in counts:
        try:
            slices = TeraPipePlan.uniform(space.seq_length, count, plan.order, space.unit)
            other = replace(plan, seq_slices=list(slices.seq_slices), wgrad_points=(),
                            wgrad_after=())
            found.append(_simulated(inputs, f"{best.name}, uniform {count} slices", other))
        except ValueError:  # over the budget, or batch slices a uniform cut cannot keep
            continue
    found = [c for c in found if c is not None]
    return min(found, key=lambda c: c.predicted_s, default=None)


def _w_switched(inputs: PlannerInputs, best: ScheduleOption) -> Optional[TrialCandidate]:
    """The best plan with its W actions in their default places when it places them, else
    placed by the planner's first policy (None without deferred weight gradients)."""
    plan = best.plan
    assert plan is not None
    if not plan.defer_wgrad:
        return None
    if plan.wgrad_after:
        return _simulated(inputs, f"{best.name}, W not placed", replace(plan, wgrad_after=()))
    space = inputs.space
    try:
        schedule = build_schedule(plan, space.num_microbatches, space.num_stages,
                                  space.micro_batch_size)
        places, _ = place_wgrad(schedule, inputs.cost_model,
                                limits=stage_limits(inputs.budget, space.num_stages),
                                memory=space.memory)
    except ValueError:  # a plan the placer cannot take (e.g. its order's own W places)
        return None
    if not any(places):
        return None
    try:
        return _simulated(inputs, f"{best.name}, W placed", replace(plan, wgrad_after=places))
    except ValueError:
        return None


def _distinct(candidates: Sequence[TrialCandidate]) -> list[TrialCandidate]:
    """The first of each plan (and name)."""
    out: list[TrialCandidate] = []
    for c in candidates:
        if all(c.name != o.name and (c.plan is None or c.plan != o.plan) for o in out):
            out.append(c)
    return out


# -- learning from the trials ---------------------------------------------------------------
def fit_trials(inputs: PlannerInputs, measured: Sequence[tuple[TrialCandidate, float]]
               ) -> Calibration:
    """The calibration of `inputs.cost_model` that fits the measured medians."""
    trials = [Trial(c.schedule, inputs.cost_model if c.plan is not None
                    else inputs.cost_model.without_scatter_gather(), seconds, c.name)
              for c, seconds in measured if c.schedule is not None]
    return fit_calibration(trials)


def replanned(inputs: PlannerInputs, calibration: Calibration, order: str, chunks: int,
              placement: str = "ring") -> Optional[TrialCandidate]:
    """The search's plan in `order` on `chunks` chunks (round the ring or in a V) with the
    calibrated cost model."""
    calibrated = replace(inputs, cost_model=calibration.apply(inputs.cost_model),
                         notes=list(inputs.notes))
    calibrated._searches.clear()
    try:
        found = (calibrated.search(order) if chunks == 1
                 else calibrated.search_virtual(order, chunks, placement))
    except ValueError:  # nothing fits under the calibrated model: the trials stand
        return None
    plan = found.plan
    if plan.virtual_placement != placement:
        return None
    name = terapipe_row_name(order, chunks, placement) + ", calibrated"
    return TrialCandidate(name, plan, found.chosen.time, found.chosen.result.schedule)


def make_replan(run: RunSettings, inputs: PlannerInputs, chunks: int,
                log: Callable[[str], None], placement: str = "ring"):
    """MeasuredChoice's replan: fit, log the error, save the calibration, re-plan in the
    order of the fastest TeraPipe candidate measured."""
    def replan(measured: Sequence[tuple[TrialCandidate, float]]) -> Optional[TrialCandidate]:
        calibration = fit_trials(inputs, measured)
        log(f"terapipe auto: calibrated cost model (x{calibration.scale:.3f}, "
            f"{calibration.per_cell_s * 1e3:+.3f} ms per cell): largest error on the trials "
            f"{100 * calibration.error_after:.1f}% (was {100 * calibration.error_before:.1f}%)"
            + (f"; {calibration.note}" if calibration.note else ""))
        save_calibration(_on_base(inputs, calibration), calibration_path(run), log)
        terapipe = sorted(((s, c) for c, s in measured if c.plan is not None),
                          key=lambda pair: pair[0])
        if not terapipe:
            return None
        extra = replanned(inputs, calibration, terapipe[0][1].plan.order, chunks, placement)
        if extra is not None and all(extra.plan != c.plan for c, _ in measured):
            log(plan_lines([extra])[0])
        return extra
    return replan


def _on_base(inputs: PlannerInputs, calibration: Calibration) -> Calibration:
    """`calibration` of a model already calibrated (an earlier run's, auto_schedule.calibrated)
    as one calibration of its base model, which is what the next start loads it onto: a cell
    x becomes s1 (s0 x + p0) + p1."""
    model = inputs.cost_model
    if not isinstance(model, CalibratedCostModel):
        return calibration
    return replace(calibration, scale=calibration.scale * model.scale,
                   per_cell_s=calibration.scale * model.per_cell_s + calibration.per_cell_s)


def calibration_path(run: RunSettings) -> Path:
    """Where this shape's calibration lives: beside the profile cache, keyed by the model,
    the run's shape and parallelism, the cost model, the device and the versions."""
    import torch

    from ...version import __version__

    shape, flags = run.shape, run.terapipe
    key = {"model": run.require_model().to_dict(), "seq_length": shape.seq_length,
           "micro_batch_size": shape.micro_batch_size, "microbatches": shape.num_microbatches,
           "pipeline": shape.pipeline_parallel, "tensor": shape.tensor_parallel,
           "sequence_parallel": shape.sequence_parallel, "dtype": shape.dtype,
           "cost_model": flags.cost_model, "hardware": flags.hardware,
           "granularity": flags.granularity, "device": device_name(),
           "versions": [torch.__version__, __version__]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(flags.cache_dir) / f"calibration-{digest}.json"


def save_calibration(calibration: Calibration, path: Path, log: Callable[[str], None]) -> None:
    """Write it whole or not at all; a cache that cannot be written is said, not fatal."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(calibration.to_dict(), indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log(f"terapipe auto: could not save the calibration to {path}: {exc}")


def load_calibration(path: Path) -> Optional[Calibration]:
    """A saved calibration, or None where there is none or it cannot be read."""
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def measured_choice(run: RunSettings, inputs: PlannerInputs, table: ScheduleTable,
                    chosen: ScheduleOption, log: Callable[[str], None]
                    ) -> tuple[MeasuredChoice, Layout]:
    """The MeasuredChoice for auto's predicted pick `chosen` and the layout it fixes."""
    chunks, placement = chosen.num_chunks, chosen.placement
    candidates = shortlist(inputs, table, chunks, placement)
    order = next((c.plan.order for c in candidates if c.plan is not None), run.terapipe.order)
    predicted = chosen.name if any(c.name == chosen.name for c in candidates) else None
    choice = MeasuredChoice(candidates, run.terapipe.auto_trials, predicted=predicted,
                            replan=make_replan(run, inputs, chunks, log, placement),
                            iterations_left=_iterations_left, log=log)
    log(f"> terapipe auto: timing {len(candidates)} schedules on {chunks} model chunk"
        f"{'s' * (chunks > 1)} per stage{' in a V' * (placement == 'v')}, "
        f"{run.terapipe.auto_trials} iterations each after a "
        f"warm-up, in interleaved rounds: {'; '.join(c.name for c in candidates)}")
    for line in plan_lines(candidates):
        log(line)
    return choice, Layout(chunks, order, placement)


def plan_lines(candidates: Sequence[TrialCandidate]) -> list[str]:
    """Each candidate's plan, exactly (`terapipe auto plan: <name> = <plan JSON>`, "megatron"
    for Megatron's schedule): what a script needs to run one of them again."""
    return [f"terapipe auto plan: {c.name} = " + (
        '"megatron"' if c.plan is None else json.dumps(c.plan.to_dict(), sort_keys=True))
        for c in candidates]


def _iterations_left() -> Optional[int]:
    """Megatron-LM's training iterations still to run (None outside Megatron-LM)."""
    args = compat.megatron_lm_global_args()
    total = getattr(args, "train_iters", None) if args is not None else None
    if total is None:
        return None
    return int(total) - int(getattr(args, "iteration", 0) or 0)
