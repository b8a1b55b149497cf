"""Planning within a memory budget: timing every leaner plan against timing only what can win.

    python benchmarks/bench_budget_planning.py [--quick] [--out FILE]

For each terapipe-plan question with a --memory-budget it runs the whole command twice in this
one process: with the budget search's step 2 as it was (every leaner plan timed:
`leaner_candidates`) and as it is (`fastest_leaner`: plans in order of a compute floor, peaks
from their lists, timing only those that fit until the floor passes the fastest), and prints both wall times and the speed-up. The two outputs (chosen
plan, predicted times, peaks, the schedule table) must be identical but for the planner's own
solve-time line; the run stops with an error otherwise. The JSON (--out; by default
benchmarks/results/planner/budget_planning.json for a run of every case) starts with its
provenance (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_terapipe.planner.cli import command as cli
from megatron_terapipe.planner import memory_search
from provenance import provenance, script_command  # noqa: E402


#: terapipe-plan questions with a memory budget (the first is the one that took minutes)
CASES = [
    "--model gpt3-13b --seq-length 8192 --pipeline-stages 8 --tensor-parallel-size 8 "
    "--micro-batch-size 4 --num-microbatches 8 --memory-budget 20GiB",
    "--model gpt3-13b --seq-length 8192 --pipeline-stages 8 --tensor-parallel-size 8 "
    "--micro-batch-size 4 --num-microbatches 8 --memory-budget 30GiB --order gpipe",
    "--model gpt3-1b --hardware v100 --seq-length 2048 --pipeline-stages 8 "
    "--micro-batch-size 8 --memory-budget 8GiB",
    "--model gpt3-1b --hardware a100 --seq-length 4096 --pipeline-stages 4 "
    "--micro-batch-size 4 --num-microbatches 4 --memory-budget 12GiB --order gpipe",
]
QUICK = CASES[2:]
_PLANNER_LINE = re.compile(r"^planner: .*$", re.MULTILINE)  # the solve time differs


def _old_fastest_leaner(cost_model, space, budget):
    """Step 2 as it was: time every leaner plan, keep the fastest that fits."""
    timed = memory_search.leaner_candidates(cost_model, space)
    fitting = [c for c in timed if memory_search.fits(c, budget)]
    if fitting:
        return min(fitting, key=lambda c: c.time), None
    return None, min(timed, key=lambda c: memory_search.peak_total(c, budget))


def _plan(argv: str, old: bool) -> tuple[float, str]:
    """terapipe-plan's wall time and output with step 2 as it was (`old`) or as it is."""
    out = io.StringIO()
    start = time.perf_counter()
    with mock.patch.object(memory_search, "fastest_leaner",
                           _old_fastest_leaner if old else memory_search.fastest_leaner), \
            contextlib.redirect_stdout(out):
        cli.main(argv.split())
    return time.perf_counter() - start, out.getvalue()


def run(cases: list[str]) -> list[dict]:
    rows = []
    for argv in cases:
        old_s, old = _plan(argv, old=True)
        new_s, new = _plan(argv, old=False)
        if _PLANNER_LINE.sub("", old) != _PLANNER_LINE.sub("", new):
            raise SystemExit(f"terapipe-plan {argv}: the outputs differ:\n{old}\n---\n{new}")
        chosen = next((line for line in new.splitlines() if line.startswith("chosen plan")), "")
        rows.append(dict(argv=argv, every_plan_timed_s=round(old_s, 2),
                         bounded_s=round(new_s, 2), speedup=round(old_s / new_s, 1),
                         same_output=True, chosen=chosen))
        print(f"terapipe-plan {argv}\n  every leaner plan timed {old_s:7.2f} s | bounded "
              f"{new_s:6.2f} s | {old_s / new_s:5.1f}x | same output (plans, times, table)",
              flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small cases")
    parser.add_argument("--cases", type=int, nargs="*", default=None,
                        help="indices into CASES (default: all)")
    parser.add_argument("--out", default=None, help="write the results as JSON here (default: "
                        "the current results file, for a run of every case)")
    args = parser.parse_args(argv)
    if args.out is None and not args.quick and args.cases is None:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "planner",
                                "budget_planning.json")
    cases = QUICK if args.quick else CASES
    origin = provenance(script_command(__file__, argv))
    rows = run([CASES[i] for i in args.cases] if args.cases is not None else cases)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"provenance": origin, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
