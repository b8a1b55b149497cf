"""Fit the analytic hardware presets' physical parameters to published runs and this project's
own GPU measurements, and write them with each fitted row's error.

    python benchmarks/fit_presets.py [--presets v100 h100] [--iterations 30]

A preset's datasheet figures (peak FLOP/s, HBM bandwidth, links' nominal speeds) stay as
presets.py gives them. Fitted, per preset (`PARAMETERS`): the GEMM efficiency large cells reach
and the rows at which it is half that, the fixed cost per layer pass, the K/V prefix's cost per
earlier slice (v100: the paper's implementation concatenated its cached pieces), the links'
effective bandwidth and latency, and the share of the data-parallel reduction not overlapped.
The targets (preset_targets.py): v100 on the TeraPipe paper's rows and its 175B slice
ablation; h100 on Megatron-LM's published H100 rows and this project's graphed H100 stage.

The fit is Levenberg-Marquardt on the log of predicted / measured, each parameter in log space
within its bounds; every prediction is the planner's own cost model and simulator. After it,
each "with slicing" row is judged with the planner's own DP plan (GPipe order, as the paper
ran). Writes megatron_terapipe/planner/cost/fitted_presets.json (--out), provenance first:
per preset its parameters, what it was fitted on, and each target's measured, predicted and
error; presets.py reads it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's package, installed or not
from megatron_terapipe.planner.cost.dims import Hardware  # noqa: E402
from megatron_terapipe.planner.cost.presets import FITTED_PRESETS_FILE, datasheet  # noqa: E402


@dataclass(frozen=True)
class Parameter:
    """A Hardware field (links: "inter_node.bandwidth") fitted in log space within bounds."""

    field: str
    start: float
    low: float
    high: float


#: Bounds keep the parameters physical: large fp16/bf16 GEMMs reach at most 80% of the
#: datasheet peak, and no GEMM is at half speed below 16 rows.
PARAMETERS: dict[str, list[Parameter]] = {
    "v100": [Parameter("matmul_efficiency", 0.7, 0.05, 0.8),
             Parameter("gemm_half_rows", 32.0, 16.0, 1e5),
             Parameter("layer_overhead", 1.5e-4, 1e-7, 0.1),
             Parameter("prefix_slice_overhead", 2.6e-5, 1e-9, 0.01),
             Parameter("intra_node.bandwidth", 2.7e10, 1e9, 1e12),
             Parameter("inter_node.bandwidth", 2.4e9, 1e8, 1e11),
             Parameter("inter_node.latency", 2.4e-3, 1e-7, 0.05),
             Parameter("dp_exposed", 0.42, 0.01, 1.0)],
    "h100": [Parameter("matmul_efficiency", 0.56, 0.05, 0.8),
             Parameter("gemm_half_rows", 34.0, 16.0, 1e5),
             Parameter("layer_overhead", 2e-5, 1e-7, 0.01),
             Parameter("intra_node.bandwidth", 3e11, 1e10, 1e12)],
}
FIXED: dict[str, dict] = {"v100": {}, "h100": {"prefix_slice_overhead": 0.0, "dp_exposed": 0.0}}


def with_values(base: Hardware, params: Sequence[Parameter], values: Sequence[float]) -> Hardware:
    """`base` with each parameter set (a link's bandwidth or latency replaced in its Link)."""
    hw = base
    for p, v in zip(params, values):
        if "." in p.field:
            link_name, attr = p.field.split(".")
            hw = replace(hw, **{link_name: replace(getattr(hw, link_name), **{attr: float(v)})})
        else:
            hw = replace(hw, **{p.field: float(v)})
    return hw


def log_errors(predict: Callable[[Hardware], np.ndarray], measured: np.ndarray,
               hardware_of: Callable[[np.ndarray], Hardware], z: np.ndarray) -> np.ndarray:
    return np.log(predict(hardware_of(z)) / measured)


def levenberg_marquardt(residuals: Callable[[np.ndarray], np.ndarray], z0: np.ndarray,
                        low: np.ndarray, high: np.ndarray, iterations: int = 30,
                        step: float = 1e-3, progress: Callable[[str], None] = print) -> np.ndarray:
    """Minimise |residuals(z)|^2 over low <= z <= high (here z: log parameters)."""
    z, lam = np.clip(z0, low, high), 1e-2
    r = residuals(z)
    for it in range(iterations):
        J = np.stack([(residuals(np.clip(z + step * e, low, high)) - r) / step
                      for e in np.eye(len(z))], axis=1)
        A, g = J.T @ J, J.T @ r
        improved = False
        for _ in range(8):
            z_new = np.clip(z - np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), g),
                            low, high)
            r_new = residuals(z_new)
            if r_new @ r_new < r @ r:
                z, r, lam, improved = z_new, r_new, lam / 3, True
                break
            lam *= 4
        progress(f"fit: iteration {it + 1}/{iterations}, largest error "
                 f"{np.max(np.abs(np.expm1(r))) * 100:.1f}%")
        if not improved or lam < 1e-9:
            break
    return z


def fit_preset(base: Hardware, params: list[Parameter], targets: list, iterations: int,
               progress: Callable[[str], None] = print) -> Hardware:
    """The Hardware whose predictions of `targets` are closest (relative) to their measures."""
    measured = np.array([t.measured for t in targets])
    low = np.log([p.low for p in params])
    high = np.log([p.high for p in params])

    def hardware_of(z: np.ndarray) -> Hardware:
        return with_values(base, params, np.exp(z))

    def predict(hw: Hardware) -> np.ndarray:
        return np.array([t.predict(hw) for t in targets])

    z = levenberg_marquardt(lambda z: log_errors(predict, measured, hardware_of, z),
                            np.log([p.start for p in params]), low, high, iterations,
                            progress=progress)
    return hardware_of(z)


def judged(hw: Hardware, targets: list) -> list[dict]:
    """Each target's measured, predicted (a "with" row: the planner's own plan) and error."""
    rows = []
    for t in targets:
        note = ""
        predicted = t.predict(hw)
        if t.judge is not None:
            predicted, note = t.judge(hw)
        rows.append({"target": t.name, "unit": t.unit, "measured": t.measured,
                     "predicted": predicted, "error": predicted / t.measured - 1,
                     **({"plan": note} if note else {})})
    return rows


def parameters_of(hw: Hardware, params: list[Parameter], fixed: dict) -> dict:
    out = dict(fixed)
    for p in params:
        if "." in p.field:
            link = p.field.split(".")[0]
            out[link] = [getattr(hw, link).bandwidth, getattr(hw, link).latency]
        else:
            out[p.field] = getattr(hw, p.field)
    return out


def speedups(rows: list[dict]) -> list[dict]:
    """The paper's with / without speedups, measured and predicted, per row."""
    out = []
    for without, with_ in zip(rows[0::2], rows[1::2]):
        if "without slicing" not in without["target"]:
            break
        m = without["measured"] / with_["measured"]
        p = without["predicted"] / with_["predicted"]
        out.append({"row": without["target"].replace(", without slicing", ""), "measured": m,
                    "predicted": p, "error": p / m - 1})
    return out


def targets_of(preset: str) -> tuple[list, str]:
    """The preset's targets and what they are, for the trust line."""
    import preset_targets as pt

    published = pt.published()
    if preset == "v100":
        targets = pt.paper_targets(published)
        rows = len(published["terapipe_paper"]["rows"])
        return targets, (f"{rows} published TeraPipe rows (with and without slicing) and its "
                         f"175B slice ablation")
    if preset == "h100":
        stage = pt.stage_targets()
        rows = len(published["megatron_lm_h100"]["rows"])
        return (pt.megatron_targets(published) + stage,
                f"{rows} published Megatron-LM rows and {len(stage)} measured stage times")
    raise SystemExit(f"fit_presets.py: no targets for preset {preset!r}: use v100 or h100")


def fit_one(preset: str, iterations: int) -> dict:
    targets, fitted_on = targets_of(preset)
    params = PARAMETERS[preset]
    base = replace(datasheet(preset), **FIXED[preset])
    t0 = time.time()
    hw = fit_preset(base, params, targets, iterations,
                    progress=lambda line: print(f"{preset} {line} ({time.time() - t0:.0f} s)",
                                                flush=True))
    rows = judged(hw, targets)
    error = max(abs(r["error"]) for r in rows)
    out = {"parameters": parameters_of(hw, params, FIXED[preset]), "fitted_on": fitted_on,
           "error": error, "measure": "iteration time" if preset == "v100"
           else "per-GPU TFLOP/s and stage time", "targets": rows}
    if preset == "v100":
        out["speedups"] = speedups(rows)
    return out


def main(argv=None) -> int:
    from provenance import provenance, script_command

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=sorted(PARAMETERS),
                        choices=sorted(PARAMETERS))
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--out", default=str(FITTED_PRESETS_FILE))
    args = parser.parse_args(argv)
    origin = provenance(script_command(__file__, argv))
    result = {"provenance": origin, "presets": {}}
    for preset in args.presets:
        result["presets"][preset] = fit_one(preset, args.iterations)
        for row in result["presets"][preset]["targets"]:
            print(f"{preset}: {row['target']}: measured {row['measured']:.4g} {row['unit']}, "
                  f"predicted {row['predicted']:.4g} ({row['error'] * 100:+.1f}%)"
                  + (f", {row['plan']}" if "plan" in row else ""))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
