"""Held-out fit error of the layer-time fit on the measured profiles this repository holds.

    python benchmarks/bench_profile_fit.py                         # this checkout's fit
    python benchmarks/bench_profile_fit.py --baseline ../old       # an older checkout's too

Each profile's cells are fitted again (`fit_layer_times`) with 20 different random held-out
shares (seeds 0-19; seed 0 is what `measure layers` reports), and the mean over seeds of the
mean and the worst relative error on the held-out cells is printed per direction. Nothing is
measured: the profiles were (on GPUs and CPUs; their own files say where). `--baseline
PATH` fits the same in a child process with the package at PATH and prints both. Writes JSON,
its provenance first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # last: a --baseline child's PYTHONPATH comes first

from provenance import describe, provenance, rows_on_checkout, script_command  # noqa: E402
from results_layout import RESULTS, profile_file  # noqa: E402

#: under benchmarks/results/; FILE#NAME: the profile NAME inside FILE's newest run. The CPU
#: profiles are the benchmarks' caches (profile_*: ignored by git), fitted where present.
PROFILES = ["gpu/h100/layer_profile.json",
            "gpu/h100/pipeline.json#profile_cuda_pp2_h4096_s2048.json",
            "gpu/h100/pipeline.json#profile_cuda_pp4_h4096_s2048.json",
            "gpu/h200/layer_profile.json",
            "cpu/profile_cpu_h256_s512.json",
            "cpu/profile_cpu_h512_s2048.json"]
SEEDS = range(20)


def fit_errors(path: str) -> dict:
    import numpy as np

    from megatron_terapipe.planner import LayerTimeFit
    from megatron_terapipe.planner.profile.least_squares import fit_layer_times

    cells = LayerTimeFit.load(path).measurements
    per_seed = [fit_layer_times(cells, seed=seed).holdout_error for seed in SEEDS]
    return {d: {k: float(np.mean([e[d][k] for e in per_seed])) for k in ("mean_relative", "max_relative")}
            for d in ("forward", "backward")}


def present() -> list[str]:
    """The PROFILES this checkout holds (a CPU cache is there only after its benchmark ran)."""
    missing = [n for n in PROFILES if not os.path.exists(os.path.join(RESULTS, n.split("#")[0]))]
    for name in missing:
        print(f"(no {name}: left out)", file=sys.stderr)
    return [n for n in PROFILES if n not in missing]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", help="another checkout's root, fitted in a child process")
    p.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    p.add_argument("--out", default=os.path.join(RESULTS, "cpu", "layer_fit_errors.json"))
    args = p.parse_args()
    if args.rows_only:
        print(json.dumps({name: fit_errors(profile_file(name)) for name in present()}))
        return 0
    origin = provenance(script_command(__file__))
    print(f"> machine: {describe(origin)}", flush=True)
    baseline = rows_on_checkout(__file__, args.baseline, ["--rows-only"]) if args.baseline else None
    rows = []
    width = max(len(name) for name in PROFILES) + 7
    print(f"{'profile':<{width}} {'forward mean/worst':>20} {'backward mean/worst':>20}")
    for name in present():
        row = {"profile": name, "fit": fit_errors(profile_file(name))}
        if baseline:
            row["baseline_fit"] = baseline[name]
        for key in ("baseline_fit", "fit") if baseline else ("fit",):
            e = row[key]
            print(f"{name + (' (old)' if key == 'baseline_fit' else ''):<{width}} "
                  f"{e['forward']['mean_relative']:>9.1%} / {e['forward']['max_relative']:>6.1%} "
                  f"{e['backward']['mean_relative']:>11.1%} / {e['backward']['max_relative']:>6.1%}")
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"provenance": origin, "baseline": args.baseline, "seeds": len(SEEDS),
                   "rows": rows}, f, indent=1)
    print(f"> wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
