"""TeraPipe on virtual pipeline stages against Megatron-Core's 1F1B and interleaved 1F1B, on one
GPU shared by the stages (CUDA MPS): bench_virtual_cpu.py's rows at bench_gpu_pipeline.py's size.

    python benchmarks/bench_gpu_virtual.py                 # 2 stages x 4 layers, hidden 4096, seq 2048
    python benchmarks/bench_gpu_virtual.py --smoke         # a tiny model; also runs on CPU

Two stage processes, each with half the SMs under MPS (mps.py), bf16 (float32 on CPU); both
sides move activations through host memory and gloo (NCCL refuses two ranks on one GPU):
Megatron's schedules and TeraPipe on one chunk through host_staged.py's communicator, TeraPipe
on 2 chunks through its torch transport staged through the host (virtual_runs_bench.py). The rows
(bench_virtual_cpu.make_rows): Megatron 1F1B on one chunk per stage, Megatron's interleaved
1F1B on 2 chunks, TeraPipe's DP plan on one chunk, the planner's plan on 2 chunks (slicing,
group, warm-up, W places), the best uniform slicing on 2 chunks, the edge walk's plan and the
planner's plan on 2 chunks in a V (host-staged like the other chunk rows); the same weights and
batches in every row, losses checked against Megatron 1F1B's, rounds interleaved. The cost
model is a layer profile measured in one process with one stage's SM share (cached, as
bench_gpu_pipeline.py measures it), with the host-staged link measured at two sizes; the
simulator gives each stage its own share. (Without an MPS daemon the stages would take turns
on the whole GPU: mps.enter_stage refuses that.) The JSON
(its provenance first, the layer profile inside) goes to --out, by default
benchmarks/results/gpu/<card>/virtual.json (replaced; --append adds the run to its runs); an
--out folder (a device session's; on CPU a scratch folder by default) gets virtual_gpu.json
(virtual_gpu_smoke.json with --smoke). The table is bench_virtual_cpu.py's.
Eager on both sides (no CUDA graphs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the multi-process harness

import torch  # noqa: E402

from bench_gpu_pipeline import GpuCase, measured_link, sm_shares  # noqa: E402
from bench_virtual_cpu import (CHUNKS, GRANULARITY, STAGES, bubble_free_limit,  # noqa: E402
                               make_rows, plan_text, print_table, result_rows)
from harness import spawn  # noqa: E402
from mps import MpsDaemon  # noqa: E402
from pipeline_runs import STAGE_BACKEND  # noqa: E402
from provenance import describe, provenance, script_command  # noqa: E402
from results_layout import (SCRATCH, default_out, earlier_runs, output_paths,  # noqa: E402
                            with_profiles, write_runs)
from virtual_runs_bench import VirtualSpeedCase  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model (seq 256, hidden 64), 2 rounds")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; 2 with --smoke)")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--fp32", dest="bf16", action="store_false", help="float32 instead of bf16")
    p.add_argument("--out", help="the results JSON (default benchmarks/results/gpu/<card>/"
                   "virtual.json), or a folder for virtual_gpu.json and the layer profile")
    p.add_argument("--append", action="store_true", help="add the run to --out's runs")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    args.out = args.out or (default_out("virtual.json", "cuda") if gpu and not args.smoke
                            else SCRATCH)
    args.json, args.folder = output_paths(
        args.out, "virtual_gpu_smoke.json" if args.smoke else "virtual_gpu.json")
    args.rounds = args.rounds or (2 if args.smoke else 5)
    if args.rounds < 1 or args.microbatches < 1:
        p.error("--rounds and --microbatches must be at least 1")
    if args.seq_length % GRANULARITY:
        p.error(f"--seq-length {args.seq_length}: a multiple of {GRANULARITY} (the slicing unit)")
    return args


def the_case(args) -> GpuCase:
    """The stages' model: 4 layers per stage (2 per chunk), hidden 4096, 32 heads."""
    if args.smoke:
        return GpuCase(STAGES, 256, args.microbatches, width=(2, 64, 4))
    return GpuCase(STAGES, args.seq_length, args.microbatches, width=(4, 4096, 32))


def measured_runs(args, case: GpuCase, model, device: str, bf16: bool) -> tuple:
    """The link and the layer profile (the cost model), the rows planned on it, and the rows
    run side by side: every stage process under the caller's MPS daemon on a GPU."""
    shape = (case.seq_length, 1, case.width[1])
    link, link_record = measured_link(shape, torch.bfloat16 if bf16 else torch.float32, device)
    cache = case.profile_cache(args.folder, device)
    cost = spawn(1, "bench_gpu_pipeline:profile_worker", case, GRANULARITY, cache, device, bf16,
                 link, timeout=3600, backend=STAGE_BACKEND[device],
                 rank_environ=sm_shares(device, STAGES, ranks=1))[0]
    rows, notes = make_rows(cost, model, args.microbatches)
    for row in rows:
        print(f"  {row.label}: {plan_text(row)}", flush=True)
    speed_case = VirtualSpeedCase(model, args.microbatches, args.rounds, CHUNKS, rows, device=device,
                                  host_staged=True, mps=device == "cuda")
    per_rank = spawn(STAGES, "virtual_runs_bench:virtual_speed_worker", speed_case, timeout=3600,
                     backend=STAGE_BACKEND[device], rank_environ=sm_shares(device, STAGES))
    return cost, rows, notes, per_rank, link_record


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = args.bf16 and device == "cuda"
    origin = provenance(script_command(__file__, argv))
    print(f"machine: {describe(origin)}", flush=True)
    started = time.perf_counter()
    case = the_case(args)
    model, M = case.model(bf16), args.microbatches
    os.makedirs(args.folder, exist_ok=True)
    earlier = earlier_runs(args.json, args.append)
    with MpsDaemon() if device == "cuda" else contextlib.nullcontext():
        cost, rows, notes, per_rank, link = measured_runs(args, case, model, device, bf16)
    shares = float(STAGES)  # each stage its own SM share (or core)
    speed = result_rows(rows, per_rank, cost, model, M, shares)
    for row in speed:  # in the row's warm-up iteration, per stage: messages sent through the
        # host-staged communicator, and received by TeraPipe's torch transport (host-staged)
        row["host_staged_messages"] = [p["staged:" + row["config"]] for p in per_rank]
        row["torch_transport_received"] = [p.get("received:" + row["config"]) for p in per_rank]
    # the targets (bench_virtual_cpu.targets) are the CPU run's: here only the limit
    limit = bubble_free_limit(cost, model, M, shares)
    results = {"provenance": origin,
               "setup": {"stages": STAGES, "chunks": CHUNKS, "num_microbatches": M,
                         "rounds": args.rounds, "smoke": args.smoke, "bf16": bf16,
                         "seq_length": model.seq_length, "hidden_size": model.hidden_size,
                         "num_layers": model.num_layers,
                         "num_attention_heads": model.num_attention_heads,
                         "vocab_size": model.vocab_size, "granularity": GRANULARITY,
                         "transfers": "host-staged (pinned host memory, gloo) on every row",
                         "graphs": "none"},
               "machine": {"device": device, "stage_shares": shares,
                           "mps": device == "cuda"},
               "link": link,
               "speed": speed, "bubble_free_limit_simulated": limit, "planning": notes,
               "wall_seconds": time.perf_counter() - started}
    write_runs(args.json, earlier + [with_profiles(results, [case.profile_cache(args.folder,
                                                                                 device)])])
    print_table(speed, shares, "SM shares (each stage its own)" if device == "cuda" else "cores")
    print(f"a schedule with no bubble: {limit:.3f}x over Megatron 1F1B (simulated)")
    print(f"wrote {os.path.relpath(args.json)} in {results['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
