"""The cost model learns from the run: fit what the simulator's predictions missed on measured
iterations, and plan with the corrected model.

A `Trial` is one measured iteration: the schedule that ran (as the simulator takes it), the cost
model it was predicted on and the measured seconds. `fit_calibration` finds the `Calibration`
that brings the simulator's iteration times closest to the measured ones (least squares on the
relative errors) under two corrections:
- `per_cell_s`: seconds added to every forward and every backward compute action (host launches
  and the runtime's own work when eager; on a GPU, what a device-timed graphed cell costs less
  than an eagerly timed profile says, which makes it negative). A model chunk's cell (virtual
  stages, Megatron's interleaved chunks) pays it whole. W actions (one per sequence's deferred
  weight gradients) are left as they are;
- `scale`: one factor on every stage's compute (layers and edges); transfers are the link's,
  measured apart, and stay as they are.
One scale for all stages, not one per stage: every stage runs the same layers and a cost model
prices a cell alike on every stage (the first and last only add their edges), and a trial gives
one number, the iteration time, to which each stage's compute contributes through the critical
path almost the same way; per-stage scales are not identifiable from such trials.

The simulator is piecewise linear in both corrections (sums and maxima of action times), so the
fit is Gauss-Newton on re-simulations: the Jacobian by finite differences at the current point,
a least-squares step, halved until the error falls; deterministic. Where the trials cannot tell
the overhead from the scale (one trial; trials of the same shape), only the scale is fitted and
`note` says so.

`Calibration.apply(cost_model)` gives a `CalibratedCostModel`: the DP slicer, the plan search and
the simulator plan with it as with any cost model. `to_dict` / `from_dict` keep it as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ...schedule import Schedule
from ..cost.arrays import scalar_or_array
from ..cost.cost_model import CostModel
from .simulator import HostFloor, schedule_time

__all__ = ["CalibratedCostModel", "Calibration", "Trial", "fit_calibration"]

#: A negative overhead takes at most this share off a cell's scaled time: fitted on the trials'
#: cells, it would otherwise price much shorter cells at nothing, and the re-planned plan then
#: cuts sequences into as many slices as the grid allows (measured on CPU with a profile scaled
#: 3x: such a plan ran twice as long as the best, benchmarks/results/megatron_lm/auto.json).
MIN_CELL_SHARE = 0.5
_SCALE_BOUNDS = (1e-4, 1e4)  # an analytic GPU preset on a CPU is 100x off
_STEP_OVERHEAD = 1e-6  # seconds: the finite difference for d(time)/d(per_cell_s)
_STEP_SCALE = 1e-4


class CalibratedCostModel(CostModel):
    """`base` with `scale` on every compute time and `per_cell_s` added to each cell's forward
    and backward (never below MIN_CELL_SHARE of the scaled time); transfers and memory as
    `base` has them. Other attributes
    (layers_per_stage, model, recompute, ...) are the base model's."""

    def __init__(self, base: CostModel, per_cell_s: float = 0.0, scale: float = 1.0):
        self.base = base
        self.per_cell_s = float(per_cell_s)
        self.scale = float(scale)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def per_action_s(self) -> float:
        """What the simulator adds whole to a chunk's cell (evaluate/simulator.py): this
        overhead, and the base model's own (scaled) where it is calibrated too."""
        return self.per_cell_s + self.scale * float(getattr(self.base, "per_action_s", 0.0))

    def _cell(self, seconds):
        scaled = self.scale * np.asarray(seconds, dtype=np.float64)
        return scalar_or_array(np.maximum(MIN_CELL_SHARE * scaled, scaled + self.per_cell_s))

    def _scaled(self, seconds):
        return scalar_or_array(self.scale * np.asarray(seconds, dtype=np.float64))

    def forward_time(self, batch, length, context):
        return self._cell(self.base.forward_time(batch, length, context))

    def backward_time(self, batch, length, context):
        return self._cell(self.base.backward_time(batch, length, context))

    def transfer_time(self, batch, length):
        return self.base.transfer_time(batch, length)

    def receive_time(self, batch, length):
        return self.base.receive_time(batch, length)

    def activation_bytes(self, batch, length, context):
        return self.base.activation_bytes(batch, length, context)

    def kv_bytes(self, batch, length):
        return self.base.kv_bytes(batch, length)

    def wgrad_hold_bytes(self, batch, length):
        return self.base.wgrad_hold_bytes(batch, length)

    def edge_forward_time(self, batch, length, first_stage, last_stage):
        return self._scaled(self.base.edge_forward_time(batch, length, first_stage, last_stage))

    def edge_backward_time(self, batch, length, first_stage, last_stage):
        return self._scaled(self.base.edge_backward_time(batch, length, first_stage, last_stage))

    def wgrad_time(self, batch, length, context, first_stage, last_stage):
        return self._scaled(self.base.wgrad_time(batch, length, context, first_stage, last_stage))

    def deferred_backward_saving(self, batch, length, context, first_stage, last_stage):
        return self._scaled(self.base.deferred_backward_saving(batch, length, context,
                                                               first_stage, last_stage))

    def recomputed_share(self, share: float = 1.0) -> float:
        return self.base.recomputed_share(share)

    def without_scatter_gather(self) -> CostModel:
        plain = self.base.without_scatter_gather()
        return self if plain is self.base else CalibratedCostModel(plain, self.per_cell_s,
                                                                   self.scale)

    def describe(self) -> str:
        return (f"{self.base.describe()}; calibrated: x{self.scale:.3f}, "
                f"{self.per_cell_s * 1e3:+.3f} ms per cell")


@dataclass(frozen=True)
class Trial:
    """One measured iteration: `schedule` ran in `measured_s` seconds; `cost_model` is what it
    was predicted on, `cores` and `host_floor` as the simulator took them."""

    schedule: Schedule
    cost_model: CostModel
    measured_s: float
    name: str = ""
    cores: Optional[float] = None
    host_floor: Optional[HostFloor] = None

    def predicted(self, per_cell_s: float = 0.0, scale: float = 1.0) -> float:
        """The simulated iteration time under these corrections."""
        model = self.cost_model
        if per_cell_s or scale != 1.0:
            model = CalibratedCostModel(model, per_cell_s, scale)
        return schedule_time(self.schedule, model, self.cores, host_floor=self.host_floor)


@dataclass(frozen=True)
class Calibration:
    """What the prediction missed, fitted on `fitted_on` (the trials' names). error_before and
    error_after: the largest |predicted / measured - 1| over those trials without and with it;
    trial_errors: each trial's with it."""

    per_cell_s: float = 0.0
    scale: float = 1.0
    fitted_on: tuple[str, ...] = ()
    error_before: float = 0.0
    error_after: float = 0.0
    trial_errors: tuple[float, ...] = field(default=())
    note: str = ""

    def apply(self, cost_model: CostModel) -> CalibratedCostModel:
        return CalibratedCostModel(cost_model, self.per_cell_s, self.scale)

    def to_dict(self) -> dict:
        return {"per_cell_s": self.per_cell_s, "scale": self.scale,
                "fitted_on": list(self.fitted_on), "error_before": self.error_before,
                "error_after": self.error_after, "trial_errors": list(self.trial_errors),
                "note": self.note}

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        return cls(per_cell_s=float(data.get("per_cell_s", 0.0)),
                   scale=float(data.get("scale", 1.0)),
                   fitted_on=tuple(data.get("fitted_on", ())),
                   error_before=float(data.get("error_before", 0.0)),
                   error_after=float(data.get("error_after", 0.0)),
                   trial_errors=tuple(float(e) for e in data.get("trial_errors", ())),
                   note=str(data.get("note", "")))


def _errors(trials: Sequence[Trial], theta: np.ndarray) -> np.ndarray:
    """Each trial's predicted / measured - 1 at theta = (per_cell_s, scale)."""
    return np.array([t.predicted(theta[0], theta[1]) / t.measured_s - 1.0 for t in trials])


def _jacobian(trials: Sequence[Trial], theta: np.ndarray, r: np.ndarray,
              free: Sequence[int]) -> np.ndarray:
    """d(errors)/d(theta[free]) by forward differences (exact between the simulator's kinks)."""
    steps = (_STEP_OVERHEAD, _STEP_SCALE)
    columns = []
    for i in free:
        moved = theta.copy()
        moved[i] += steps[i]
        columns.append((_errors(trials, moved) - r) / steps[i])
    return np.stack(columns, axis=1)


def _identifiable(jacobian: np.ndarray) -> bool:
    """Whether the columns (overhead, scale) tell apart: not (near) parallel."""
    if jacobian.shape[0] < 2:
        return False
    norms = np.linalg.norm(jacobian, axis=0)
    if np.any(norms == 0):
        return False
    singular = np.linalg.svd(jacobian / norms, compute_uv=False)
    return singular[-1] > 1e-3 * singular[0]


def _clip(theta: np.ndarray, limit: float) -> np.ndarray:
    return np.array([np.clip(theta[0], -limit, limit), np.clip(theta[1], *_SCALE_BOUNDS)])


def _gauss_newton(trials: Sequence[Trial], theta: np.ndarray, free: Sequence[int],
                  iterations: int) -> np.ndarray:
    """Least squares of the relative errors over theta[free], from `theta`."""
    limit = max(t.measured_s for t in trials)
    r = _errors(trials, theta)
    for _ in range(iterations):
        jacobian = _jacobian(trials, theta, r, free)
        step = np.linalg.lstsq(jacobian, -r, rcond=None)[0]
        loss, improved = float(r @ r), False
        for _ in range(12):  # halve the step until the error falls
            trial_theta = theta.copy()
            trial_theta[list(free)] += step
            trial_theta = _clip(trial_theta, limit)
            trial_r = _errors(trials, trial_theta)
            if float(trial_r @ trial_r) < loss:
                theta, r, improved = trial_theta, trial_r, True
                break
            step = step / 2
        if not improved or np.max(np.abs(step)) < 1e-12:
            break
    return theta


def fit_calibration(trials: Sequence[Trial], iterations: int = 30) -> Calibration:
    """The per-cell overhead and the scale that fit `trials` best (see the module's
    docstring); only the scale where the trials cannot tell the two apart."""
    if not trials:
        raise ValueError("a calibration needs at least one measured trial")
    bad = [t.name for t in trials if not t.measured_s > 0]
    if bad:
        raise ValueError(f"trials {bad}: measured times must be positive seconds")
    theta = np.array([0.0, 1.0])
    before = _errors(trials, theta)
    free, note = (0, 1), ""
    if not _identifiable(_jacobian(trials, theta, before, (0, 1))):
        free = (1,)
        note = ("the trials cannot tell a per-cell overhead from a scale (one trial, or trials "
                "of the same shape): the scale alone is fitted")
    theta = _gauss_newton(trials, theta, free, iterations)
    after = _errors(trials, theta)
    return Calibration(per_cell_s=float(theta[0]), scale=float(theta[1]),
                       fitted_on=tuple(t.name for t in trials),
                       error_before=float(np.max(np.abs(before))),
                       error_after=float(np.max(np.abs(after))),
                       trial_errors=tuple(float(e) for e in after), note=note)
