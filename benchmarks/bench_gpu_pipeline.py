"""TeraPipe against Megatron's own 1F1B on a pipeline whose stages share one GPU (CUDA MPS).

    python benchmarks/bench_gpu_pipeline.py                  # the suite on one GPU under MPS
    python benchmarks/bench_gpu_pipeline.py --cases smoke    # a tiny case, also runs on CPU

Each case starts one process per stage under MPS, each with 100/N % of the SMs (mps.py), and
runs Megatron-Core's unmodified 1F1B, TeraPipe with the DP plan and TeraPipe with the best
uniform slicing, interleaved round by round (pipeline_runs.speed_worker); activations travel
through pinned host memory and gloo for both (host_staged.py), whose cost alone is measured
first. The cost model is a layer profile measured at start in one process with one stage's SM
share (cached). It writes JSON and a PNG (measured vs predicted) to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

from harness import TinyGPT, spawn  # noqa: E402
from pipeline_runs import SpeedCase, plans_for, predict  # noqa: E402


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

    def model(self, bf16: bool) -> TinyGPT:
        layers, hidden, heads = self.width
        return TinyGPT(num_layers=self.stages * layers, hidden_size=hidden,
                       num_attention_heads=heads, vocab_size=32000, seq_length=self.seq_length,
                       params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16)


SUITES = {
    "full": [GpuCase(k, s, m) for k in (2, 4) for s in (2048, 8192) for m in (1, 4)],
    "smoke": [GpuCase(2, 256, 1, width=(1, 64, 4))],
}


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


def profile_worker(rank: int, world_size: int, case: GpuCase, granularity: int, cache: str,
                   device: str, bf16: bool):
    """The layer profile measured with one stage's SM share (a single process under MPS)."""
    from pipeline_runs import profile_cost_model

    if device == "cuda":
        from mps import enter_stage

        enter_stage(0, case.stages)
    return profile_cost_model(case.model(bf16), granularity, case.layers_per_stage, device, cache,
                              dtype="bfloat16" if bf16 else "float32")


def run_case(case: GpuCase, args, device: str) -> list[dict]:
    model = case.model(args.bf16)
    cache = os.path.join(args.out, f"profile_{device}_pp{case.stages}_h{case.width[1]}_s{case.seq_length}.json")
    cost = spawn(1, "bench_gpu_pipeline:profile_worker", case, args.granularity, cache, device,
                 args.bf16, timeout=3600)[0]
    plans, info = plans_for(cost, model, case.num_microbatches, args.granularity, case.stages)
    print(f"{case.name}: DP {info['dp_order']} {info['dp_slices']} (+W {info['dp_defer_wgrad']}); "
          f"uniform {info['uniform_slices']} slices", flush=True)
    speed = SpeedCase(case.name, model, case.num_microbatches, args.granularity, args.repeats,
                      plans, mps=device == "cuda", cuda_graphs=args.cuda_graphs)
    per_rank = spawn(case.stages, "pipeline_runs:speed_worker", speed, device, timeout=3600)
    rows = []
    for label, plan in plans.items():
        runs = [max(r[label][i] for r in per_rank) for i in range(args.repeats)]
        rows.append({"case": case.name, "config": label, "stages": case.stages,
                     "seq_length": case.seq_length, "num_microbatches": case.num_microbatches,
                     "slices": None if plan is None else list(plan.seq_slices),
                     "order": None if plan is None else plan.order,
                     "defer_wgrad": None if plan is None else plan.defer_wgrad,
                     "measured_s": statistics.median(runs), "runs_s": runs,
                     "predicted_s": predict(cost, plan, model, case.num_microbatches,
                                            float(case.stages), case.stages),
                     "peak_bytes": [r.get("peak:" + label, [None])[0] for r in per_rank]})
    mega = next(r["runs_s"] for r in rows if r["config"] == "megatron_1f1b")
    for r in rows:
        r["speedup_vs_megatron"] = statistics.median(m / t for m, t in zip(mega, r["runs_s"]))
        r["sim_error"] = r["predicted_s"] / r["measured_s"] - 1.0
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':<20} {'schedule':<17} {'slices':>6} {'measured ms':>11} {'predicted ms':>12} "
          f"{'sim err':>7} {'vs 1F1B':>8} {'peak GiB per stage':>20}")
    for r in rows:
        n = "-" if r["slices"] is None else f"{len(r['slices'])}{'+W' if r['defer_wgrad'] else ''}"
        peaks = " / ".join("-" if p is None else f"{p / 2**30:.1f}" for p in r["peak_bytes"])
        print(f"{r['case']:<20} {r['config']:<17} {n:>6} {r['measured_s'] * 1e3:>11.1f} "
              f"{r['predicted_s'] * 1e3:>12.1f} {r['sim_error']:>+6.1%} "
              f"{r['speedup_vs_megatron']:>7.2f}x {peaks:>20}")


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["measured_s"] * 1e3 for r in rows], width=0.4, label="measured (median)")
    ax.bar([i + 0.2 for i in x], [r["predicted_s"] * 1e3 for r in rows], width=0.4, label="simulator")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['case']}\n{r['config']}" for r in rows], fontsize=6)
    ax.set_ylabel("ms per iteration")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", choices=tuple(SUITES), default="full")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--granularity", type=int, default=64)
    p.add_argument("--fp32", dest="bf16", action="store_false", help="float32 instead of bf16")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="TeraPipe replays a CUDA graph per compute action (CPU: the ReplayGraph "
                        "stand-in, which checks the path, not the speed)")
    p.add_argument("--out", default="benchmarks/results/gpu_pipeline")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        args.bf16 = False
    started = time.perf_counter()
    results = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               "torch": torch.__version__, "command": " ".join(sys.argv),
               "cuda_graphs": args.cuda_graphs, "rows": []}
    context = None
    if device == "cuda":
        from mps import MpsDaemon

        context = MpsDaemon()
        context.__enter__()
    try:
        shape = (2048, 1, 4096) if args.cases == "full" else (256, 1, 64)
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        one_way = spawn(2, "bench_gpu_pipeline:transfer_worker", shape, dtype, 20, device == "cuda")[0]
        results["transfer_one_way_s"] = {"shape": list(shape), "seconds": one_way}
        print(f"> host-staged transfer of {list(shape)} {dtype}: {one_way * 1e3:.3f} ms one way", flush=True)
        for case in SUITES[args.cases]:
            results["rows"].extend(run_case(case, args, device))
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    results["wall_seconds"] = time.perf_counter() - started
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_table(results["rows"])
    try:
        chart(results["rows"], os.path.join(args.out, "schedules.png"))
    except ImportError:
        print("(no matplotlib: skipped the chart)")
    print(f"> wrote {args.out}/results.json in {results['wall_seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
