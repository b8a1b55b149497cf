"""Host work per iteration and per cell on CPU, where compute is negligible: does a cell's host
work stay flat as the number of token slices K grows?

    python benchmarks/bench_host_ops.py          # hidden 64, seq 512, 4 layers, one process

One process runs a whole tiny GPT as one stage (PP=1, one microbatch) through Megatron's
`forward_backward_no_pipelining` (unsliced), and through `forward_backward_terapipe` with K
uniform token slices and the default plan (deferred weight gradients). Both run the same
attention, TeraPipe's slice-aware spec (one torch SDPA call per layer; ordinary causal attention
outside a TeraPipe cell), on copies of the same weights, so the op counts and host times
compare the schedules, not attention kernels. `--megatron-local-spec` adds Megatron on its
local spec (unfused DotProductAttention), a row labelled as such. Per row: aten ops dispatched in one iteration (a TorchDispatchMode), per cell
(ops / K), the median host time of an iteration (perf_counter; on CPU that is all of it), and
for TeraPipe how many graphs `--terapipe-cuda-graphs` would capture for the plan and the aten
ops a replayed iteration still dispatches outside them (counted with runtime/graphs/cell_graphs.py's
RecordingGraph, whose replays run nothing). Targets: TeraPipe at K = 1 no more ops than
Megatron's unsliced iteration on the same attention; ops per cell at K = 32 within 1.1x of
K = 1. Writes benchmarks/results/cpu/host_ops.json, its provenance first (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_stage  # noqa: E402  (its models, batch, iteration and op counter)
import megatron_terapipe as mt  # noqa: E402
from megatron_terapipe.runtime.graphs.cell_graphs import RecordingGraph  # noqa: E402
from provenance import describe, provenance, script_command  # noqa: E402


@dataclass
class HostOpsRow:
    name: str
    attention: str  # bench_stage.ATTENTION's description
    slices: int
    ops_per_iteration: int
    ops_per_cell: float
    host_ms: float
    graphs: Optional[int] = None  # graphs the plan would capture (TeraPipe rows)
    ops_outside_graphs: Optional[int] = None  # aten ops of a replayed iteration


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--slices", default="1,8,32")
    p.add_argument("--megatron-local-spec", action="store_true",
                   help="also count Megatron on its local spec (unfused attention: not the same "
                        "attention as the other rows)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--out", default=os.path.join(HERE, "results", "cpu", "host_ops.json"))
    args = p.parse_args(argv)
    args.slice_counts = [int(k) for k in args.slices.split(",")]
    if any(k <= 0 or args.seq_length % k for k in args.slice_counts):
        p.error(f"--slices: each count must be positive and divide --seq-length {args.seq_length}")
    # bench_stage's model options
    args.device, args.num_attention_heads, args.micro_batch_size, args.vocab_size = "cpu", 4, 1, 1024
    args.bf16 = args.cuda_graphs = False
    return args


def count_ops(run: Callable[[], None]) -> int:
    with bench_stage._OpCounter() as counter:
        run()
    return counter.ops


def host_ms(run: Callable[[], None], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_counts(model, plan, batch, args) -> tuple[int, int]:
    """(graphs captured, aten ops of a replayed iteration) with recording graphs, on the
    model's own plan memory set aside for the count."""
    config = model.config
    saved = model.__dict__.pop("_terapipe_pools", None)
    graphs: list[RecordingGraph] = []
    own = getattr(config, "terapipe", None) or mt.TeraPipeConfig()
    config.terapipe = dataclasses.replace(
        own, cuda_graphs=True,
        graph_factory=lambda key: graphs.append(RecordingGraph(key)) or graphs[-1])
    # Replays write the gradients where the capture put them: zeroed in place, not set to None.
    graph_args = argparse.Namespace(**{**vars(args), "cuda_graphs": True})
    run = lambda: bench_stage.iteration(mt.forward_backward_terapipe, model, batch, graph_args, plan=plan)  # noqa: E731
    try:
        run()  # eager warm-up
        run()  # capture
        # The benchmark's own zeroing of the gradients (in place, one op per parameter) is
        # done before the count: what is counted is the schedule's replayed iteration.
        model.zero_grad(set_to_none=False)
        replayed_ops = count_ops(lambda: mt.forward_backward_terapipe(
            forward_step_func=bench_stage.forward_step, data_iterator=iter([batch]),
            model=[model], num_microbatches=1, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, plan=plan))
    finally:
        config.terapipe = own
        model.__dict__.pop("_terapipe_pools", None)
        if saved is not None:
            model._terapipe_pools = saved
    return len(graphs), replayed_ops


def megatron_rows(models: dict, batch: dict, args) -> list[HostOpsRow]:
    """Megatron's own schedule, unsliced: on the slice-aware spec, and (when asked) its local spec."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    rows = []
    for side, name, attention in (
            ("megatron", "Megatron, unsliced (SDPA)", bench_stage.SDPA),
            ("megatron_local", "Megatron local spec, unsliced (unfused attention)", bench_stage.UNFUSED)):
        if side not in models:
            continue
        model = models[side]
        run = lambda: bench_stage.iteration(forward_backward_no_pipelining, model, batch, args)  # noqa: E731
        ms = host_ms(run, args.warmup, args.iters)
        ops = count_ops(run)
        rows.append(HostOpsRow(name, bench_stage.ATTENTION[attention], 1, ops, float(ops), ms))
        print(_format(rows[-1]), flush=True)
    return rows


def run_all(args) -> list[HostOpsRow]:
    models = bench_stage.build_models(args)
    ours = models["terapipe"]
    batch = bench_stage.make_batch(args)
    rows = megatron_rows(models, batch, args)
    for k in args.slice_counts:
        plan = mt.TeraPipePlan.uniform(args.seq_length, k)
        run = lambda: bench_stage.iteration(mt.forward_backward_terapipe, ours, batch, args, plan=plan)  # noqa: E731
        ms = host_ms(run, args.warmup, args.iters)
        ops = count_ops(run)
        graphs, outside = graph_counts(ours, plan, batch, args)
        rows.append(HostOpsRow(f"TeraPipe, {k} slices (SDPA)", bench_stage.ATTENTION[bench_stage.SDPA],
                               k, ops, ops / k, ms, graphs, outside))
        print(_format(rows[-1]), flush=True)
    return rows


def _format(r: HostOpsRow) -> str:
    graphs = "-" if r.graphs is None else str(r.graphs)
    outside = "-" if r.ops_outside_graphs is None else str(r.ops_outside_graphs)
    return (f"{r.name:50s} {r.ops_per_iteration:10d} {r.ops_per_cell:10.1f} {r.host_ms:9.2f} "
            f"{graphs:>7s} {outside:>10s}")


def main(argv=None) -> None:
    args = parse_args(argv)
    bench_stage.init_process("cpu")
    origin = provenance(script_command(__file__, argv))
    print(f"machine: {describe(origin)}; 1 thread", flush=True)
    torch.set_num_threads(1)
    print(f"{'run':50s} {'ops/iter':>10s} {'ops/cell':>10s} {'host ms':>9s} {'graphs':>7s} "
          f"{'replay ops':>10s}", flush=True)
    rows = run_all(args)
    megatron = next(r for r in rows if r.name.startswith("Megatron,"))  # the same attention
    one = next(r for r in rows if r.name.startswith("TeraPipe") and r.slices == 1)
    targets = {
        "k1_ops_vs_megatron": one.ops_per_iteration / megatron.ops_per_iteration,
        "ops_per_cell_vs_k1": {r.slices: r.ops_per_cell / one.ops_per_cell
                               for r in rows if r.name.startswith("TeraPipe")}}
    print(f"> TeraPipe K=1 / Megatron ops (both SDPA): {targets['k1_ops_vs_megatron']:.3f}; ops "
          f"per cell vs K=1: {targets['ops_per_cell_vs_k1']}")
    result = {"provenance": origin, "threads": 1,
              "shape": {"hidden_size": args.hidden_size, "seq_length": args.seq_length,
                        "num_layers": args.num_layers, "num_attention_heads": 4,
                        "vocab_size": args.vocab_size, "micro_batch_size": 1},
              "rows": [asdict(r) for r in rows], "targets": targets}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"> wrote {args.out}")


if __name__ == "__main__":
    main()
