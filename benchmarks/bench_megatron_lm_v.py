"""The V through Megatron-LM's own pretrain_gpt.py on CPU: is TeraPipe on 2 chunks per rank in a
V faster than Megatron's 1F1B, and than Megatron's interleaved schedule on the same chunks?

Every row runs the launcher (`--terapipe-cpu`) on 2 stages, 4 untied layers, seq 2048, hidden
512, 4 microbatches, on the same slice-aware model (SDPA attention: Megatron's schedules with
`--terapipe-slice-aware-model`), eager on both sides:

- Megatron 1F1B (one chunk per stage);
- Megatron interleaved (`--num-virtual-stages-per-pipeline-rank 2`);
- TeraPipe in a V, one slice (`--terapipe-num-slices 1`: the V's placement alone);
- TeraPipe in a V, the planner's own plan on the default cost model (analytic, an A100
  assumed), and on this machine's layer profile (`--terapipe-cost-model profile`, measured by
  the first round's run and cached for the others).

A row's time is the median of Megatron's iteration timer ("elapsed time per iteration") over
its iterations after --warmup; the rows run in --rounds interleaved rounds, and each row's
ratio to Megatron's 1F1B is the median of its per-round ratios (load that drifts between rounds
cancels). Losses are not compared here: a model built in chunks starts from other weights
(tests/glue/test_megatron_lm_v.py compares through a checkpoint).

    python benchmarks/bench_megatron_lm_v.py --checkout MEGATRON_LM [--rounds 5]

Writes benchmarks/results/megatron_lm/v.json (--out), provenance first.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_auto import launch, model_flags as auto_model_flags  # noqa: E402
from provenance import provenance, script_command  # noqa: E402

TIMED = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([0-9.]+)")
PLAN = re.compile(r"^>   (?:token slices \(all rows\)|virtual stages) \.+ (.+)$", re.M)
V = ["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "terapipe",
     "--terapipe-virtual-placement", "v"]
ROWS = {
    "megatron_1f1b": ["--pipeline-schedule", "1f1b", "--terapipe-slice-aware-model"],
    "megatron_interleaved": ["--pipeline-schedule", "1f1b", "--terapipe-slice-aware-model",
                             "--num-virtual-stages-per-pipeline-rank", "2"],
    "terapipe_v_one_slice": [*V, "--terapipe-num-slices", "1"],
    "terapipe_v_planned": V,
    "terapipe_v_planned_on_profile": [*V, "--terapipe-cost-model", "profile"],
}


def model_flags(args) -> list[str]:
    """bench_auto's model (4 layers, one chunk: each row adds its own), embeddings untied."""
    model = argparse.Namespace(layers=4, seq_length=args.seq_length,
                               hidden_size=args.hidden_size, chunks=1)
    return [*auto_model_flags(model, args.microbatches), "--untie-embeddings-and-output-weights"]


def timed_run(args, row: str) -> tuple[float, str]:
    """One row's median iteration time (s) after the warm-up, and its plan as the log gives it
    (token slices; virtual stages)."""
    log = launch(args, ["-m", "megatron_terapipe.megatron.launch"],
                 [*model_flags(args), *ROWS[row], "--terapipe-cache-dir", args.cache_dir],
                 args.iterations)
    times = [float(ms) / 1e3 for i, ms in TIMED.findall(log) if int(i) > args.warmup]
    return statistics.median(times), "; ".join(PLAN.findall(log))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, help="Megatron-LM checkout")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="iterations left out of a median")
    parser.add_argument("--out", default=str(HERE / "results/megatron_lm/v.json"))
    args = parser.parse_args(argv)
    args.cache_dir = tempfile.mkdtemp(prefix="bench-v-")  # the profile row's, measured once
    origin = provenance(script_command(__file__, argv))
    start = time.perf_counter()
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    slices: dict[str, str] = {}
    for r in range(args.rounds):
        for row in ROWS:
            seconds, slices[row] = timed_run(args, row)
            times[row].append(seconds)
        print(f"round {r + 1} of {args.rounds}: " + ", ".join(
            f"{row} {t[-1]:.3f} s" for row, t in times.items()), flush=True)
    base = times["megatron_1f1b"]
    rows = [{"row": row, "flags": ROWS[row], "slices": slices[row], "rounds_s": t,
             "median_s": statistics.median(t),
             "speedup_over_1f1b": statistics.median(b / x for b, x in zip(base, t))}
            for row, t in times.items()]
    result = {"provenance": origin, "seq_length": args.seq_length,
              "hidden_size": args.hidden_size, "layers": 4, "microbatches": args.microbatches,
              "rounds": args.rounds, "iterations": args.iterations, "warmup": args.warmup,
              "seconds": round(time.perf_counter() - start, 1), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(f"{row['row']:24s} {row['median_s']:.3f} s  {row['speedup_over_1f1b']:.3f}x  "
              f"{row['slices']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
