"""Planner speed: the exact DP slicer on three sizes, against their time targets;
the whole plan search on the README's terapipe-plan examples; and (--measure) how long
measuring a tiny layer takes here, with what it measured. Tests check what these produce, not
how fast: the timings live here.

    python benchmarks/bench_planner.py [--repeats 3] [--measure]

Slicer cost model: the analytic model of a GPT3-13B layer (40 layers, hidden 5120) on V100, one
layer per stage on 40 stages, and the paper's GPT3-175B shape (2 layers per stage, TP=8). Times
are wall-clock seconds of `solve_slicing` (the best of the repeats); simulating the chosen plan
is reported separately.
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
from megatron_terapipe.planner.search import SearchSpace, search  # noqa: E402
from megatron_terapipe.schedule import build_schedule  # noqa: E402

# (model, layers per stage, TP, seq length, granularity, micro batch size, stages, target s)
CASES = [
    ("gpt3-13b", 1, 1, 2048, 8, 32, 40, 1.0),
    ("gpt3-13b", 1, 1, 32768, 64, 32, 40, 2.0),
    ("gpt3-13b", 1, 1, 131072, 256, 32, 40, 5.0),
    ("gpt3-13b", 1, 1, 32768, 64, 1, 40, 2.0),
    ("gpt3-13b", 1, 1, 131072, 256, 1, 40, 5.0),
    ("gpt3-175b", 2, 8, 2048, 8, 32, 40, 1.0),  # the paper's size
]

# The README's terapipe-plan examples: (model, hardware, TP, stages, seq, granularity, micro
# batch, microbatches, order)
SEARCHES = [
    ("gpt3-175b", "a100", 8, 48, 32768, 64, 1, 4, "1f1b"),
    ("gpt3-1b", "v100", 1, 8, 2048, 8, 8, 1, "gpipe"),
]


def _cost(model: str, layers: int, tp: int, hardware: str = "v100") -> AnalyticCostModel:
    return AnalyticCostModel(model_preset(model), hardware_preset(hardware), layers_per_stage=layers,
                             tensor_parallel=tp, inter_node=True)


def bench_slicer(repeats: int, batch_sizes: str, simulate_plans: bool) -> bool:
    header = (f"{'model':>9} {'seq':>7} {'gran':>5} {'rows':>5} {'stages':>6} {'DP units':>8} "
              f"{'solve s':>8} {'target s':>8} {'ok':>3} {'DPs':>5} {'cells':>6} "
              f"{'vs uniform':>10} {'vs none':>8} {'simulate s':>10}")
    print(header)
    print("-" * len(header))
    all_ok = True
    for model, layers, tp, seq, gran, rows, K, target in CASES:
        cost = _cost(model, layers, tp)
        best, solution = float("inf"), None
        for _ in range(repeats):
            started = time.perf_counter()
            solution = solve_slicing(cost, seq, rows, K, granularity=gran, batch_sizes=batch_sizes)
            best = min(best, time.perf_counter() - started)
        assert solution is not None
        _, uniform = best_uniform_slicing(cost, seq, rows, K, granularity=gran)
        whole = plan_objective(TeraPipePlan([seq]), cost, rows, K)
        sim = "-"
        if simulate_plans:
            started = time.perf_counter()
            simulate(build_schedule(solution.plan, 1, K, rows), cost)
            sim = f"{time.perf_counter() - started:.2f}"
        ok = best < target
        all_ok &= ok
        print(f"{model:>9} {seq:>7} {gran:>5} {rows:>5} {K:>6} {seq // gran:>8} {best:>8.3f} "
              f"{target:>8.1f} {'yes' if ok else 'NO':>3} {solution.dp_evaluations:>5} "
              f"{solution.plan.num_cells:>6} {uniform / solution.objective:>9.3f}x "
              f"{whole / solution.objective:>7.2f}x {sim:>10}")
    print("vs uniform / vs none: objective of the best uniform slicing / of no token slicing, "
          "divided by the DP's (higher is better for the DP)")
    return all_ok


def bench_search() -> None:
    """The whole search (DP, simulated candidates, refinement) on the README's examples."""
    print(f"\n{'search (terapipe-plan example)':<44} {'seconds':>8} {'chosen':<28}")
    for model, hardware, tp, K, seq, gran, rows, M, order in SEARCHES:
        layers = model_preset(model).num_layers // K
        cost = AnalyticCostModel(model_preset(model), hardware_preset(hardware), layers,
                                 tensor_parallel=tp, inter_node=tp * K > 8)
        started = time.perf_counter()
        result = search(cost, SearchSpace(seq, rows, K, M, order, granularity=gran))
        label = f"{model} {hardware} K={K} seq={seq} M={M} {order}"
        print(f"{label:<44} {time.perf_counter() - started:>8.2f} {result.chosen.label:<28}")


def bench_measure() -> None:
    """Measuring a tiny layer and its edges on this CPU (what the measure tests run)."""
    from megatron_terapipe.megatron.measure.layers import measure_layer_times
    from megatron_terapipe.planner import ModelDims, default_grid

    model = ModelDims(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=512)
    cells = default_grid(128, [1, 2], granularity=16, points=4)
    started = time.perf_counter()
    m = measure_layer_times(model, cells, dtype="float32", repeats=2, progress=False)
    seconds = time.perf_counter() - started
    print(f"\nmeasuring hidden 64 on {len(cells)} cells (+ edges), repeats 2: {seconds:.1f} s")
    print(f"{'batch':>5} {'length':>6} {'context':>7} {'forward ms':>10} {'backward ms':>11}")
    for b, l, c, f, bw in zip(m.batch, m.length, m.context, m.forward, m.backward):
        print(f"{int(b):>5} {int(l):>6} {int(c):>7} {1e3 * f:>10.3f} {1e3 * bw:>11.3f}")
    e = m.edges
    print(f"{'batch':>5} {'length':>6} {'embedding fwd+bwd ms':>21} {'output fwd+bwd ms':>18}")
    for i in range(len(e)):
        print(f"{int(e.batch[i]):>5} {int(e.length[i]):>6} "
              f"{1e3 * (e.embedding_forward[i] + e.embedding_backward[i]):>21.3f} "
              f"{1e3 * (e.output_forward[i] + e.output_backward[i]):>18.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-sizes", default="divisors", help="divisors (default), all or none")
    p.add_argument("--no-simulate", action="store_true", help="skip simulating the chosen plans")
    p.add_argument("--measure", action="store_true", help="also time measuring a tiny layer")
    args = p.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"cost model: analytic on v100, inter-node links; batch slice sizes: {args.batch_sizes}")
    all_ok = bench_slicer(args.repeats, args.batch_sizes, not args.no_simulate)
    bench_search()
    if args.measure:
        bench_measure()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
