"""Host time TeraPipe spends on a microbatch's attention mask before any compute: the check that
it is causal (CellData) and, under Megatron-LM's scripts, the decision to drop it per cell
(CellBatches).

    python benchmarks/bench_mask_check.py                          # this checkout
    python benchmarks/bench_mask_check.py --baseline ../old  # an older checkout too, and ratios

Megatron-LM's GPT datasets hand every sample a [1, 1, s, s] bool mask (True = masked) on the
CPU; TeraPipe reads it there, before get_batch moves it to the GPU. An H100 profile of
`pretrain_gpt.py` (docs/performance.md) found this host work at about 23 ms per 2048-token
microbatch, more than Megatron's whole iteration took per microbatch. Per sequence length and
number of token slices K: the median over repeats of reading one microbatch through CellData and
every cell of it through CellBatches, its tensors staged into a buffer pool as the executor
stages them, one torch thread (as Megatron-LM's launcher runs a rank).
`--baseline PATH` runs the same in a child process on the package at PATH (e.g. a `git worktree`
of an older commit) and prints old / new. Writes JSON, its provenance first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # last: a --baseline child's PYTHONPATH comes first

from provenance import describe, provenance, rows_on_checkout, script_command  # noqa: E402


def one_microbatch_ms(seq_length: int, slices: int, repeats: int) -> float:
    import torch

    from megatron_terapipe import TeraPipePlan
    from megatron_terapipe.megatron.hooks.lm_cells import CellBatches
    from megatron_terapipe.runtime.batching import CellData
    from megatron_terapipe.runtime.memory.buffer_pool import BufferPool
    from megatron_terapipe.schedule import microbatch_cells

    torch.set_num_threads(1)
    plan = TeraPipePlan([seq_length // slices] * slices)
    cells = microbatch_cells(plan, 0, 1)
    times = []
    pool = BufferPool()  # the executor's: it stages each microbatch's tensors (copies them)
    for _ in range(repeats + 1):  # the first warms the allocator and caches
        # a fresh mask per microbatch, as the dataset's collate makes one
        mask = torch.tril(torch.ones(1, 1, seq_length, seq_length)) < 0.5
        batch = {"tokens": torch.zeros(1, seq_length, dtype=torch.long), "attention_mask": mask}
        start = time.perf_counter()
        data = CellData(iter([batch]), seq_length, 1, pool=pool)
        for cell in cells:
            next(CellBatches(data.iterator_for(cell), cell, must_drop_mask=False))
        data.release_staged()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def measure(cases: list[tuple[int, int]], repeats: int) -> list[dict]:
    return [{"seq_length": s, "slices": k, "ms_per_microbatch": one_microbatch_ms(s, k, repeats)}
            for s, k in cases]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lengths", default="2048,8192")
    p.add_argument("--slices", default="1,8")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--baseline", help="another checkout's root, measured in a child process")
    p.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    p.add_argument("--out", default=os.path.join(HERE, "results", "cpu", "mask_check.json"))
    args = p.parse_args()
    cases = [(int(s), int(k)) for s in args.seq_lengths.split(",") for k in args.slices.split(",")]
    if args.rows_only:
        print(json.dumps(measure(cases, args.repeats)))
        return 0
    origin = provenance(script_command(__file__))
    print(f"> machine: {describe(origin)}", flush=True)
    baseline = None
    if args.baseline:
        baseline = rows_on_checkout(__file__, args.baseline, [
            "--rows-only", "--seq-lengths", args.seq_lengths, "--slices", args.slices,
            "--repeats", str(args.repeats)])
    rows = measure(cases, args.repeats)
    header = f"{'seq':>6} {'slices':>6} {'ms per microbatch':>18}"
    print(header + (f" {'baseline ms':>12} {'old/new':>8}" if baseline else ""))
    for i, r in enumerate(rows):
        line = f"{r['seq_length']:>6} {r['slices']:>6} {r['ms_per_microbatch']:>18.2f}"
        if baseline:
            r["baseline_ms_per_microbatch"] = baseline[i]["ms_per_microbatch"]
            r["speedup"] = r["baseline_ms_per_microbatch"] / r["ms_per_microbatch"]
            line += f" {r['baseline_ms_per_microbatch']:>12.2f} {r['speedup']:>7.2f}x"
        print(line)
    with open(args.out, "w") as f:
        json.dump({"provenance": origin, "baseline": args.baseline, "rows": rows}, f, indent=1)
    print(f"> wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
