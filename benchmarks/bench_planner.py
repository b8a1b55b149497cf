"""Planner speed: the exact DP slicer on the sizes issue #3 asks for, against their targets.

    python benchmarks/bench_planner.py [--repeats 3]

Cost model: the analytic model of a GPT3-13B layer (40 layers, hidden 5120) on V100, one layer
per stage on 40 stages. Times are wall-clock seconds of `solve_slicing` (the best of the
repeats); simulating the chosen plan is reported separately.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_terapipe.plan import TeraPipePlan  # noqa: E402
from megatron_terapipe.planner import (  # noqa: E402
    AnalyticCostModel,
    best_uniform_slicing,
    hardware_preset,
    model_preset,
    plan_objective,
    simulate,
    solve_slicing,
)
from megatron_terapipe.schedule import build_schedule  # noqa: E402

# (seq length, granularity, micro batch size, stages, target seconds)
CASES = [
    (2048, 8, 32, 40, 1.0),
    (32768, 64, 32, 40, 2.0),
    (131072, 256, 32, 40, 5.0),
    (32768, 64, 1, 40, 2.0),
    (131072, 256, 1, 40, 5.0),
]


def time_solver(seq: int, granularity: int, rows: int, stages: int, repeats: int = 3,
                batch_sizes: str = "divisors"):
    """Best-of-`repeats` seconds of solve_slicing on the analytic GPT3-13B / V100 model."""
    cost = AnalyticCostModel(model_preset("gpt3-13b"), hardware_preset("v100"),
                             layers_per_stage=1, inter_node=True)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        solve_slicing(cost, seq, rows, stages, granularity=granularity, batch_sizes=batch_sizes)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-sizes", default="divisors", help="divisors (default), all or none")
    p.add_argument("--no-simulate", action="store_true", help="skip simulating the chosen plans")
    args = p.parse_args()
    model = model_preset("gpt3-13b")
    cost = AnalyticCostModel(model, hardware_preset("v100"), layers_per_stage=1, inter_node=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"cost model: {cost.describe()}; batch slice sizes: {args.batch_sizes}")
    header = (f"{'seq':>7} {'gran':>5} {'rows':>5} {'stages':>6} {'DP units':>8} {'solve s':>8} "
              f"{'target s':>8} {'ok':>3} {'DPs':>5} {'cells':>6} {'vs uniform':>10} "
              f"{'vs none':>8} {'simulate s':>10}")
    print(header)
    print("-" * len(header))
    all_ok = True
    for seq, gran, rows, K, target in CASES:
        best = float("inf")
        solution = None
        for _ in range(args.repeats):
            started = time.perf_counter()
            solution = solve_slicing(cost, seq, rows, K, granularity=gran, batch_sizes=args.batch_sizes)
            best = min(best, time.perf_counter() - started)
        assert solution is not None
        _, uniform = best_uniform_slicing(cost, seq, rows, K, granularity=gran)
        whole = plan_objective(TeraPipePlan([seq]), cost, rows, K)
        sim = "-"
        if not args.no_simulate:
            started = time.perf_counter()
            simulate(build_schedule(solution.plan, 1, K, rows), cost)
            sim = f"{time.perf_counter() - started:.2f}"
        ok = best < target
        all_ok &= ok
        print(f"{seq:>7} {gran:>5} {rows:>5} {K:>6} {seq // gran:>8} {best:>8.3f} {target:>8.1f} "
              f"{'yes' if ok else 'NO':>3} {solution.dp_evaluations:>5} {solution.plan.num_cells:>6} "
              f"{uniform / solution.objective:>9.3f}x {whole / solution.objective:>7.2f}x {sim:>10}")
    print("vs uniform / vs none: objective of the best uniform slicing / of no token slicing, "
          "divided by the DP's (higher is better for the DP)")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
