"""Two runs of Megatron-LM's `pretrain_gpt.py` side by side, from their logs: the losses and
grad norms of every iteration, and the iteration times after warm-up.

gpu_session.sh's `megatron-lm` part logs one run per schedule (terapipe, 1f1b) on the device;
this reads those logs where they were copied and writes one JSON beside them:

    python benchmarks/megatron_lm_logs.py RUN_DIR [--warmup 2]

RUN_DIR holds megatron_lm_terapipe.log and megatron_lm_1f1b.log (and device.log with the card).
The `megatron-lm-profile` part's logs: `--prefix megatron_lm_profile --through 23` (its
iterations 24-26 run under torch.profiler, whose overhead is not the schedule's; logs of 12
iterations, profiled from 10: `--through 9`).
gpu_session.sh runs it on the device after the two runs, so the provenance is the device's; for
logs summarised elsewhere, --logs-commit names the commit the device ran (kept as logs_commit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import provenance, script_command  # noqa: E402

ITERATION = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([0-9.]+).*"
                       r"lm loss: ([0-9.E+-]+).*grad norm: ([0-9.]+)")


@dataclass
class Run:
    """One schedule's iterations, as its log printed them."""

    schedule: str
    iterations: list[int]
    milliseconds: list[float]
    lm_loss: list[float]
    grad_norm: list[float]

    def timed_ms(self, warmup: int, through: int | None = None) -> list[float]:
        last = len(self.milliseconds) if through is None else self.iterations.index(through) + 1
        return self.milliseconds[warmup:last]

    def median_ms(self, warmup: int, through: int | None = None) -> float:
        return statistics.median(self.timed_ms(warmup, through))

    def spread_ms(self, warmup: int, through: int | None = None) -> dict:
        """The timed iterations' count, least, quartiles and most: how far the median holds."""
        timed = sorted(self.timed_ms(warmup, through))
        q1, _, q3 = (statistics.quantiles(timed, n=4) if len(timed) > 1 else timed * 3)
        return {"iterations": len(timed), "min": timed[0], "q1": q1, "q3": q3, "max": timed[-1]}


def read_run(path: str, schedule: str) -> Run:
    with open(path, encoding="utf-8", errors="replace") as log:
        found = ITERATION.findall(log.read())
    if not found:
        raise ValueError(f"{path}: no Megatron-LM iteration lines (did the run start?)")
    return Run(schedule, [int(i) for i, *_ in found], [float(ms) for _, ms, _, _ in found],
               [float(loss) for *_, loss, _ in found], [float(norm) for *_, norm in found])


def compare(terapipe: Run, megatron: Run, warmup: int, through: int | None = None) -> dict:
    """Relative differences per iteration and the median iteration times after `warmup` (up to
    iteration `through`, where given)."""
    if terapipe.iterations != megatron.iterations:
        raise ValueError(f"the runs logged different iterations: {terapipe.iterations} against "
                         f"{megatron.iterations}")
    if len(terapipe.iterations) <= warmup:
        raise ValueError(f"--warmup {warmup} leaves no iteration of {len(terapipe.iterations)}")
    if through is not None and (through not in terapipe.iterations or through <= warmup):
        raise ValueError(f"--through {through}: not a logged iteration after the warm-up "
                         f"({terapipe.iterations})")

    def relative(a: list[float], b: list[float]) -> list[float]:
        return [abs(x - y) / abs(y) for x, y in zip(a, b)]

    loss, norm = relative(terapipe.lm_loss, megatron.lm_loss), relative(terapipe.grad_norm,
                                                                       megatron.grad_norm)
    ms_terapipe, ms_megatron = terapipe.median_ms(warmup, through), megatron.median_ms(warmup, through)
    return {"max_relative_lm_loss_difference": max(loss),
            "max_relative_grad_norm_difference": max(norm),
            "warmup_iterations_left_out": warmup, "timed_through_iteration": through,
            "median_ms_terapipe": ms_terapipe, "median_ms_1f1b": ms_megatron,
            "spread_ms_terapipe": terapipe.spread_ms(warmup, through),
            "spread_ms_1f1b": megatron.spread_ms(warmup, through),
            "terapipe_over_1f1b_speed": ms_megatron / ms_terapipe}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--warmup", type=int, default=2, help="first iterations left out of the times")
    parser.add_argument("--logs-commit", help="the commit the logs' runs ran, where summarised elsewhere")
    parser.add_argument("--prefix", default="megatron_lm", help="the logs' names: PREFIX_terapipe.log")
    parser.add_argument("--through", type=int, help="the last iteration timed (default: all)")
    args = parser.parse_args(argv)
    logs = {s: os.path.join(args.run_dir, f"{args.prefix}_{s}.log") for s in ("terapipe", "1f1b")}
    runs = {s: read_run(path, s) for s, path in logs.items()}
    device = os.path.join(args.run_dir, "device.log")
    result = {"provenance": provenance(script_command(__file__, argv)),
              "measured_from": sorted(os.path.basename(p) for p in logs.values()),
              "logs_commit": args.logs_commit,
              "device": open(device).read().strip() if os.path.exists(device) else None,
              "summary": compare(runs["terapipe"], runs["1f1b"], args.warmup, args.through),
              "runs": [asdict(r) for r in runs.values()]}
    out = os.path.join(args.run_dir, f"{args.prefix}_logs.json" if args.prefix != "megatron_lm"
                       else "megatron_lm.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    summary = result["summary"]
    spread = {s: summary[f"spread_ms_{s}"] for s in ("terapipe", "1f1b")}
    print(f"> lm loss within rel {summary['max_relative_lm_loss_difference']:.2e}, grad norm "
          f"within rel {summary['max_relative_grad_norm_difference']:.2e}; median ms per iteration "
          f"over {spread['terapipe']['iterations']} iterations: terapipe "
          f"{summary['median_ms_terapipe']:.1f} (quartiles {spread['terapipe']['q1']:.1f}-"
          f"{spread['terapipe']['q3']:.1f}), 1f1b {summary['median_ms_1f1b']:.1f} (quartiles "
          f"{spread['1f1b']['q1']:.1f}-{spread['1f1b']['q3']:.1f}) "
          f"({summary['terapipe_over_1f1b_speed']:.2f}x); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
