"""What starting the tests' gloo workers costs: a fresh interpreter each, or a fork of a server
that imported torch and megatron.core once (tests/harness/spawn.py).

    python benchmarks/bench_spawn.py            # 2 ranks, 3 calls per start method

Each call is `spawn(2, ...)` of a target that only initialises and destroys Megatron's parallel
state, timed on the host clock; each method's first call includes its one-time costs (the
forkserver's start and imports). Writes benchmarks/results/cpu/spawn.json (provenance first).
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from provenance import describe, provenance, script_command  # noqa: E402


# the module, not the function `harness.spawn` that the package exports under the same name
harness_spawn = importlib.import_module("harness.spawn")


def megatron_parallel_state(rank: int, world_size: int) -> int:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, world_size)
    parallel_state.destroy_model_parallel()
    return rank


def time_calls(calls: int, ranks: int) -> list[float]:
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        harness_spawn.spawn(ranks, "bench_spawn:megatron_parallel_state")
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu",
                                                 "spawn.json"))
    args = p.parse_args()
    origin = provenance(script_command(__file__))
    print(f"> machine: {describe(origin)}", flush=True)
    harness_default = harness_spawn._context
    results = {"provenance": origin, "ranks": args.ranks, "methods": {}}
    for method, context in (("spawn", lambda: mp.get_context("spawn")), ("harness", harness_default)):
        harness_spawn._context = context
        runs = time_calls(args.calls, args.ranks)
        results["methods"][method] = {"start_method": context().get_start_method(), "seconds": runs}
        print(f"{method:>8} ({context().get_start_method()}): "
              + ", ".join(f"{s:.2f} s" for s in runs), flush=True)
    harness_spawn._context = harness_default
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"> wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
