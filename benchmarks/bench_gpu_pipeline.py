"""TeraPipe against Megatron's own 1F1B on a pipeline whose stages share one GPU (CUDA MPS).

    python benchmarks/bench_gpu_pipeline.py                  # the suite on one GPU under MPS
    python benchmarks/bench_gpu_pipeline.py --cases smoke    # a tiny case, also runs on CPU

Each case starts one process per stage under MPS, each with 100/N % of the SMs (mps.py), and
runs Megatron-Core's unmodified 1F1B, TeraPipe with the DP plan, the DP plan with its W actions
placed by the planner (where that is faster in simulation: "terapipe_dp_w_placed") and TeraPipe
with the best uniform slicing, interleaved round by round (pipeline_runs.speed_worker); activations travel
through pinned host memory and gloo for both (host_staged.py), whose cost alone is measured
first, at two sizes: the simulator's link. The cost model is a layer profile measured at start
in one process with one stage's SM share (cached beside the JSON). It writes the JSON (its
provenance first, the layer profiles it planned on inside: results_layout.py) to --out, by
default benchmarks/results/gpu/<card>/pipeline.json (replaced; --append adds the run to its
runs), and prints the table; an --out folder (a device session's) gets results.json. Before
the rounds, measured auto (`--auto-trials`, measured_auto.py) tries each way's rows.

Graphs on both sides or none: `--cuda-graphs` keeps the eager rows (Megatron 1F1B and both
TeraPipe plans, compared with each other) and adds the TeraPipe plans with a graph per compute
action ("+graphs") and Megatron's 1F1B with Megatron-Core's own graphs (`cuda_graph_impl=local`,
a graph per transformer layer call; `--megatron-graphs none` leaves it out). A row's ratio is
to the Megatron row with the same graphs, never to an eager one from a graphed one: without a
graphed Megatron row (on CPU Megatron's graphs cannot run; or `--megatron-graphs none`; or
Megatron's capture failed, which the JSON records before the case is rerun without it) the
graphed TeraPipe rows have no ratio; if they fail too (an H100 ran out of memory so), the case
reruns eager on both sides, every error in the JSON's `graphs_error`. Each row names its graphs. The graphed rows' scopes still
differ: TeraPipe graphs whole compute actions (embedding, loss and K/V writes included),
Megatron only its transformer layers. Beside that ratio, "vs best" is to the fastest Megatron
row of each round, graphed or not: what a user who runs Megatron its faster way would see.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

from harness import TinyGPT, WorkerError, spawn  # noqa: E402
from pipeline_plans import plans_for, predict, w_placed_plans  # noqa: E402
from pipeline_runs import GRAPHS, STAGE_BACKEND, SpeedCase, graphs_of  # noqa: E402
from provenance import describe, provenance, script_command  # noqa: E402
from measured_auto import auto_rows, join_added, print_auto  # noqa: E402
from mps import stage_environ  # noqa: E402
from results_layout import (default_out, earlier_runs, output_paths, with_profiles,  # noqa: E402
                            write_runs)


@dataclass(frozen=True)
class GpuCase:
    stages: int
    seq_length: int
    num_microbatches: int
    width: tuple[int, int, int] = (4, 4096, 32)  # layers per stage, hidden size, heads

    @property
    def layers_per_stage(self) -> int:
        return self.width[0]

    @property
    def name(self) -> str:
        return f"pp{self.stages}_seq{self.seq_length}_M{self.num_microbatches}"

    def profile_cache(self, folder: str, device: str, timing: str = "wall") -> str:
        """Where a run caches the layer profile it measured for this case's stage width (timed
        on the wall clock, or `_device` for the GPU's own time)."""
        clock = "" if timing == "wall" else f"_{timing}"
        name = f"profile_{device}_pp{self.stages}_h{self.width[1]}_s{self.seq_length}{clock}.json"
        return os.path.join(folder, name)

    def model(self, bf16: bool) -> TinyGPT:
        layers, hidden, heads = self.width
        return TinyGPT(num_layers=self.stages * layers, hidden_size=hidden,
                       num_attention_heads=heads, vocab_size=32000, seq_length=self.seq_length,
                       params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16)


SUITES = {
    "full": [GpuCase(k, s, m) for k in (2, 4) for s in (2048, 8192) for m in (1, 4)],
    # the three target cases (2 and 4 stages at 1 microbatch, 4 stages at 4), for a short lease
    "targets": [GpuCase(2, 2048, 1), GpuCase(4, 2048, 1), GpuCase(4, 2048, 4)],
    # terapipe-plan's question (32 layers, 8 stages, seq 2048, 1 microbatch), measured
    "eight": [GpuCase(8, 2048, 1)], "smoke": [GpuCase(2, 256, 1, width=(1, 64, 4))],
}


def sm_shares(device: str, num_stages: int, ranks: Optional[int] = None):
    """Each stage process's SM share under MPS, for spawn's rank_environ (none on CPU)."""
    return stage_environ(num_stages, ranks) if device == "cuda" else None


def transfer_worker(rank: int, world_size: int, shape: tuple, dtype: torch.dtype, repeats: int,
                    mps: bool) -> float:
    """Seconds per one-way transfer of `shape` through the host-staged communicator (ping-pong)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    if mps:
        from mps import enter_stage

        enter_stage(rank, world_size)
    from host_staged import HostStagedP2PCommunicator

    parallel_state.initialize_model_parallel(1, world_size)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, pipeline_dtype=dtype)
    comm = HostStagedP2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    device = "cuda" if mps else "cpu"
    x = torch.randn(shape, device=device).to(dtype)
    first = rank == 0
    for i in range(repeats + 2):
        if i == 2:
            start = time.perf_counter()
        if first:
            comm.send_forward(x, False)
            comm.recv_backward(torch.Size(shape), False)
        else:
            comm.recv_forward(torch.Size(shape), False)
            comm.send_backward(x, False)
    seconds = (time.perf_counter() - start) / (2 * repeats)
    parallel_state.destroy_model_parallel()
    return seconds


def measured_link(shape: tuple, dtype: torch.dtype, device: str) -> tuple:
    """The stage-to-stage Link the simulator prices transfers with, fitted to the host-staged
    communicator's one-way time at `shape` and at an eighth of its tokens (latency + bytes /
    bandwidth), and the measurements: an assumed loopback rate (100 GB/s) is 30x off where the
    host-staged transfer of a 2048-token activation takes 5-7 ms (about 3 GB/s)."""
    small = (max(shape[0] // 8, 1),) + tuple(shape[1:])
    points = []
    for size in (small, shape):
        seconds = spawn(2, "bench_gpu_pipeline:transfer_worker", size, dtype, 20, device == "cuda",
                        rank_environ=sm_shares(device, 2))[0]
        points.append((torch.Size(size).numel() * torch.empty((), dtype=dtype).element_size(), seconds))
    link = link_through(points)
    record = {"points": [{"shape": list(size), "bytes": b, "seconds": t}
                         for size, (b, t) in zip((small, shape), points)],
              "bandwidth_bytes_per_s": link.bandwidth, "latency_s": link.latency}
    return link, record


def link_through(points: list) -> "Link":
    """The Link (latency + bytes / bandwidth) through two (bytes, seconds) measurements, the
    smaller message first; where the larger took no longer, its bytes over its time and no
    latency (never a negative latency or bandwidth)."""
    from megatron_terapipe.planner.cost.dims import Link

    (b0, t0), (b1, t1) = points
    if t1 > t0 and b1 > b0:
        bandwidth = (b1 - b0) / (t1 - t0)
        return Link(bandwidth=bandwidth, latency=max(t0 - b0 / bandwidth, 0.0))
    return Link(bandwidth=b1 / t1, latency=0.0)


def profile_worker(rank: int, world_size: int, case: GpuCase, granularity: int, cache: str,
                   device: str, bf16: bool, link=None, timing: str = "wall"):
    """The layer profile measured with one stage's SM share (a single process under MPS)."""
    from pipeline_plans import profile_cost_model

    if device == "cuda":
        from mps import enter_stage

        enter_stage(0, case.stages)
    return profile_cost_model(case.model(bf16), granularity, case.layers_per_stage, device, cache,
                              dtype="bfloat16" if bf16 else "float32", link=link, timing=timing)


def labelled_plans(plans: dict, args, device: str) -> tuple[dict, tuple[str, ...]]:
    """The case's labels and which run graphed: with --cuda-graphs each TeraPipe plan again with
    its graphs, and Megatron's 1F1B with Megatron's own graphs where they can run."""
    if not args.cuda_graphs:
        return dict(plans), ()
    labelled = dict(plans)
    graphed = []
    for label, plan in plans.items():
        if plan is not None or (device == "cuda" and args.megatron_graphs == "local"):
            labelled[label + "+graphs"] = plan
            graphed.append(label + "+graphs")
    return labelled, tuple(graphed)


def timed(speed: SpeedCase, case: GpuCase, device: str) -> tuple[SpeedCase, list, Optional[str]]:
    """Every rank's times. If the run fails with graphed rows, the error and a rerun without
    Megatron's graphs, then, if that fails too, without any graphs (eager on both sides: the
    4-stage x 4-microbatch case can run out of an H100's memory with graphed rows, which would
    cost the case its eager rows too)."""
    errors = []
    while True:
        try:
            per_rank = spawn(case.stages, "pipeline_runs:speed_worker", speed, device, timeout=3600,
                             backend=STAGE_BACKEND[device], rank_environ=sm_shares(device, case.stages))
            return speed, per_rank, "; ".join(errors) or None
        except WorkerError as exc:
            megatron = [label for label in speed.graphed if speed.plans[label] is None]
            dropped = megatron or list(speed.graphed)
            if not dropped:
                raise
            errors.append(str(exc).strip().splitlines()[-1])
            which = "Megatron's graphs" if megatron else "the graphed rows"
            print(f"{case.name}: {which} failed ({errors[-1]}); rerunning without them", flush=True)
            speed = replace(speed, plans={k: v for k, v in speed.plans.items() if k not in dropped},
                            graphed=tuple(k for k in speed.graphed if k not in dropped))


def with_ratios(rows: list[dict]) -> None:
    """Each row's ratio to the Megatron row with the same graphs, or none (and why); and to the
    fastest Megatron row of each round, whatever its graphs."""
    megatron = {r["graphs"]: r for r in rows if r["order"] is None}
    for r in rows:
        # A graphed TeraPipe row pairs with the graphed Megatron row, an eager one with eager.
        base = megatron.get("none" if r["graphs"] == "none" else "megatron")
        r["baseline"] = None if base is None else base["config"]
        r["speedup_vs_megatron"] = (None if base is None else statistics.median(
            m / t for m, t in zip(base["runs_s"], r["runs_s"])))
        r["no_ratio"] = (None if base is not None else
                         "no Megatron row with graphs to compare with (an eager one would not be fair)")
        r["sim_error"] = r["predicted_s"] / r["measured_s"] - 1.0
    # Beside it, what a user choosing Megatron's faster way to run would see: per round, the
    # fastest Megatron row of that round (graphed or eager) over this row.
    runs = [r["runs_s"] for r in megatron.values()]
    for r in rows:
        r["speedup_vs_fastest_megatron"] = (None if not runs else statistics.median(
            min(m[i] for m in runs) / t for i, t in enumerate(r["runs_s"])))


def run_case(case: GpuCase, args, device: str, link=None) -> tuple[list[dict], list[dict]]:
    """The case's rows, and measured auto's pick per way of running (measured_auto.py)."""
    model = case.model(args.bf16)
    cache = case.profile_cache(args.folder, device, args.profile_timing)
    cost = spawn(1, "bench_gpu_pipeline:profile_worker", case, args.granularity, cache, device,
                 args.bf16, link, args.profile_timing, timeout=3600, backend=STAGE_BACKEND[device],
                 rank_environ=sm_shares(device, case.stages, ranks=1))[0]
    plans, info = plans_for(cost, model, case.num_microbatches, args.granularity, case.stages)
    print(f"{case.name}: DP {info['dp_order']} {info['dp_slices']} (+W {info['dp_defer_wgrad']}); "
          f"uniform {info['uniform_slices']} slices", flush=True)
    plans.update(w_placed_plans(plans, cost, case))
    plans, graphed = labelled_plans(plans, args, device)
    def predicted_s(plan):
        return predict(cost, plan, model, case.num_microbatches, float(case.stages), case.stages)

    predicted = {label: predicted_s(plan) for label, plan in plans.items()}
    speed = SpeedCase(case.name, model, case.num_microbatches, args.granularity, args.repeats,
                      plans, mps=device == "cuda", graphed=graphed, auto_trials=args.auto_trials,
                      predicted=predicted, cost=cost)
    speed, per_rank, graphs_error = timed(speed, case, device)
    predicted.update(join_added(speed, per_rank[0].get("auto", {}), predicted_s))
    rows = []
    for label, plan in speed.plans.items():
        runs = [max(r[label][i] for r in per_rank) for i in range(args.repeats)]
        graphs = graphs_of(label, plan, speed, device)
        rows.append({"case": case.name, "config": label, "stages": case.stages,
                     "seq_length": case.seq_length, "num_microbatches": case.num_microbatches,
                     "slices": None if plan is None else list(plan.seq_slices),
                     "plan": None if plan is None else plan.to_dict(),
                     "order": None if plan is None else plan.order,
                     "defer_wgrad": None if plan is None else plan.defer_wgrad,
                     "w_placed": plan is not None and bool(plan.wgrad_after),
                     "graphs": graphs, "graphs_detail": GRAPHS[graphs],
                     "graphs_error": graphs_error,  # what failed before the rows that ran
                     "measured_s": statistics.median(runs), "runs_s": runs,
                     "predicted_s": predicted[label],
                     "peak_bytes": [r.get("peak:" + label, [None])[0] for r in per_rank],
                     "added_peak_bytes": [r.get("added:" + label, [None])[0] for r in per_rank]})
    with_ratios(rows)
    return rows, auto_rows(case.name, rows, per_rank[0].get("auto", {}))


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':<20} {'schedule':<28} {'graphs':<9} {'slices':>6} {'measured ms':>11} "
          f"{'predicted ms':>12} {'sim err':>7} {'vs 1F1B':>8} {'vs best':>8} {'GiB added':>20}")
    for r in rows:
        n = "-" if r["slices"] is None else (f"{len(r['slices'])}{'+W' if r['defer_wgrad'] else ''}"
                                             f"{'p' if r.get('w_placed') else ''}")
        peaks = " / ".join("-" if p is None else f"{p / 2**30:.1f}"
                           for p in r.get("added_peak_bytes", r["peak_bytes"]))
        ratio = "-" if r["speedup_vs_megatron"] is None else f"{r['speedup_vs_megatron']:.2f}x"
        best = r.get("speedup_vs_fastest_megatron")
        best = "-" if best is None else f"{best:.2f}x"
        graphs = {"none": "eager", "megatron": "layers", "terapipe": "actions",
                  "terapipe_cpu": "stand-in"}[r["graphs"]]
        print(f"{r['case']:<20} {r['config']:<28} {graphs:<9} {n:>6} {r['measured_s'] * 1e3:>11.1f} "
              f"{r['predicted_s'] * 1e3:>12.1f} {r['sim_error']:>+6.1%} {ratio:>8} {best:>8} "
              f"{peaks:>20}")
    print("(slices: +W deferred weight gradients, +Wp placed by the planner; graphs: layers: "
          "Megatron-Core's, a graph per transformer layer call; actions: a CUDA graph per "
          "TeraPipe compute action; stand-in: ReplayGraph on CPU. vs 1F1B: the median ratio to "
          "the Megatron row with the same graphs ('-': none); vs best: to each round's fastest "
          "Megatron row. GiB added: a stage's peak over what it held as the row's run began)")


def write_results(results: dict, args, started: float) -> None:
    """The run so far, with the layer profiles of the cases it ran inside."""
    results["wall_seconds"] = time.perf_counter() - started
    ran = {r["case"] for r in results["rows"]}
    caches = [c.profile_cache(args.folder, results["device"], args.profile_timing)
              for c in SUITES[args.cases] if c.name in ran]
    write_runs(args.json, args.earlier + [with_profiles(results, caches)])


def parse_args() -> tuple[argparse.Namespace, str]:
    """The options, checked before any work; and the device the run uses."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", choices=tuple(SUITES), default="full")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--granularity", type=int, default=64)
    p.add_argument("--fp32", dest="bf16", action="store_false", help="float32 instead of bf16")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="add graphed rows: TeraPipe with a CUDA graph per compute action (CPU: "
                        "the ReplayGraph stand-in, which checks the path, not the speed) and "
                        "Megatron with its own graphs (CUDA only); the eager rows stay")
    p.add_argument("--megatron-graphs", choices=("local", "none"), default="local",
                   help="with --cuda-graphs: Megatron-Core's cuda_graph_impl for its graphed "
                        "row (none: no graphed Megatron row, and no ratio for graphed TeraPipe)")
    p.add_argument("--profile-timing", choices=("wall", "device"), default="wall",
                   help="the layer profile's clock, for every row's plan and prediction: wall "
                        "(host launches included, what an eager cell costs) or device (the GPU's "
                        "own time, what a graphed cell costs; CUDA only)")
    p.add_argument("--out", help="the results JSON (default benchmarks/results/gpu/<card>/"
                   "pipeline.json; on CPU a scratch folder's), or a folder for results.json")
    p.add_argument("--append", action="store_true", help="add the run to --out's runs")
    p.add_argument("--auto-trials", type=int, default=2, help="measured auto's trials per row, "
                   "among each way's rows before the rounds (measured_auto.py; 0: none)")
    args = p.parse_args()
    if args.auto_trials < 0:
        p.error(f"--auto-trials must be 0 or more, got {args.auto_trials}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out = args.out or default_out("pipeline.json", device, scratch=device == "cpu")
    args.json, args.folder = output_paths(args.out, "results.json")
    args.earlier = earlier_runs(args.json, args.append)
    if args.profile_timing == "device" and device == "cpu":
        p.error("--profile-timing device measures GPU time and this machine has no CUDA device: "
                "use --profile-timing wall (the default)")
    if device == "cpu":
        args.bf16 = False
    return args, device


def main() -> int:
    args, device = parse_args()
    os.makedirs(args.folder, exist_ok=True)
    started = time.perf_counter()
    origin = provenance(script_command(__file__))
    print(f"> machine: {describe(origin)}", flush=True)
    results = {"provenance": origin, "device": device, "cuda_graphs": args.cuda_graphs,
               "profile_timing": args.profile_timing,
               "megatron_graphs": args.megatron_graphs if args.cuda_graphs else None, "rows": [],
               "auto": []}
    context = None
    if device == "cuda":
        from mps import MpsDaemon

        context = MpsDaemon()
        context.__enter__()
    try:
        shape = (256, 1, 64) if args.cases == "smoke" else (2048, 1, 4096)
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        link, results["link"] = measured_link(shape, dtype, device)
        one_way = results["link"]["points"][-1]["seconds"]
        results["transfer_one_way_s"] = {"shape": list(shape), "seconds": one_way}
        print(f"> host-staged transfer of {list(shape)} {dtype}: {one_way * 1e3:.3f} ms one way; "
              f"the simulator's link: {link.latency * 1e3:.3f} ms + {link.bandwidth / 1e9:.2f} GB/s",
              flush=True)
        for case in SUITES[args.cases]:
            rows, auto = run_case(case, args, device, link)
            results["rows"].extend(rows)
            results["auto"].extend(auto)
            write_results(results, args, started)  # a lease can end before the last case
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    write_results(results, args, started)
    print_table(results["rows"])
    print_auto(results["auto"])
    print(f"> wrote {args.json} in {results['wall_seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
