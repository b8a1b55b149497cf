"""One pipeline stage's forward+backward cut into K token slices, against Megatron's own run.

    python benchmarks/bench_stage.py                                   # CPU, a small GPT
    python benchmarks/bench_stage.py --device cuda --bf16 --hidden-size 4096 \
        --num-attention-heads 32 --seq-length 2048 --num-layers 4      # one GPU

A whole GPT (embedding, layers, output layer and loss) runs as one stage (PP=1), one microbatch,
through `forward_backward_terapipe` with K uniform token slices, and through Megatron's
`forward_backward_no_pipelining` on the same weights. Both sides run the same attention:
TeraPipe's slice-aware spec (one torch SDPA call per layer; outside a TeraPipe cell it is
ordinary causal attention), so the rows differ in the schedule and the slicing, not in the
attention kernels. The Megatron side is its own copy of the model, which TeraPipe's hooks never
touch. `--megatron-local-spec` adds a row of Megatron's local spec, whose unfused
DotProductAttention dispatches several times the aten ops of one SDPA call: a comparison of
attention kernels, labelled as such. Every row names its attention.
Per K it prints the median iteration time (CUDA events after warm-up on a GPU, perf_counter on
CPU), the host time (the call's wall time up to its return, before the device is synchronised),
the GPU-busy time (kernel time in torch.profiler), kernel launches (GPU) or dispatched aten ops
(CPU) per cell, host syncs per cell, the ratio to 1 slice, and how many graphs capturing each
distinct cell once would take (cells alike in kind, rows, tokens and context share one). The
JSON copy (--out, its provenance first: benchmarks/provenance.py) also has the aten ops per
iteration. Host ops against Megatron on a tiny stage, with what a replayed iteration leaves:
bench_host_ops.py.

--cuda-graphs captures every compute action of the TeraPipe runs as a CUDA graph at the second
warm-up iteration and times the replays (`--terapipe-cuda-graphs`). On CPU it uses ReplayGraph,
the stand-in that replays captured aten ops: that checks the path and counts ops, and says
nothing about the speed of CUDA graphs. Megatron's row stays eager (each row says whether it
is graphed): compare graphed rows with graphed rows only.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pretrain_gpt's forward_step and three-value loss, as the tests use them.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import megatron_terapipe as mt  # noqa: E402
from harness import forward_step, in_precision, to_device, use_cell_graphs  # noqa: E402
from provenance import describe, provenance, script_command  # noqa: E402
from results_layout import default_out  # noqa: E402

# Profiler names of host-device synchronisations, and of kernel launches.
SYNC_EVENTS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
               "aten::_local_scalar_dense")
# A replayed CUDA graph is one cudaGraphLaunch from the host.
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                 "cudaGraphLaunch")


#: Each row's attention, named in the row.
SDPA = "SDPA"  # TeraPipe's slice-aware spec: one torch SDPA call per layer
UNFUSED = "unfused"  # Megatron's local spec: DotProductAttention's separate matmuls and softmax
ATTENTION = {SDPA: "torch SDPA, one call per layer (slice-aware spec)",
             UNFUSED: "unfused DotProductAttention (Megatron local spec)"}


@dataclass
class StageRow:
    """One line of the table: a schedule and a slicing on one stage."""

    name: str
    attention: str  # ATTENTION's description
    graphed: bool  # a CUDA graph (CPU: ReplayGraph) per compute action
    slices: int
    median_ms: float
    host_ms: float
    gpu_busy_ms: Optional[float]
    launches_per_cell: float  # kernel launches (GPU) or dispatched aten ops (CPU)
    syncs_per_cell: float
    times_ms: list[float] = field(default_factory=list)
    ratio_to_1_slice: Optional[float] = None
    ops_per_iteration: Optional[int] = None  # dispatched aten ops (CPU)
    cell_graphs: Optional[int] = None  # distinct cells (kind, rows, tokens, context): one graph each


class _OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops and the ones that read a tensor's value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


# The stage's model and batch shape (integer options and their defaults).
SHAPE = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 1024,
         "micro_batch_size": 1, "vocab_size": 1024}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    for name, default in SHAPE.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    p.add_argument("--slices", default="1,2,4,8,16,32", help="comma-separated token-slice counts")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--defer-wgrad", choices=("plan", "on", "off"), default="plan",
                   help="weight gradients in W actions: the plan's default, or forced")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay a CUDA graph per compute action (CPU: the ReplayGraph stand-in)")
    p.add_argument("--megatron-local-spec", action="store_true",
                   help="also time Megatron on its local spec (unfused attention: not the same "
                        "attention as the other rows)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cpu/"
                   "stage.json; gpu/<card>/stage.json, stage_graphs.json with --cuda-graphs)")
    args = p.parse_args(argv)
    args.slice_counts = [int(k) for k in args.slices.split(",")]
    bad = [k for k in args.slice_counts if k <= 0 or args.seq_length % k]
    if bad:
        p.error(f"--slices {bad}: each count must be positive and divide --seq-length {args.seq_length}")
    if args.cuda_graphs and args.warmup < 2:
        p.error("--cuda-graphs needs --warmup >= 2 (an eager iteration, then the capture)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    return args


def init_process(device: str) -> None:
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if device == "cpu":
        mt.enable_cpu_mode()
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(1, 1)


def seed(device: str, value: int = 1234) -> None:
    from megatron.core import tensor_parallel

    torch.manual_seed(value)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(value)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def build_models(args) -> dict[str, torch.nn.Module]:
    """The same GPT, same weights, one copy per side: "terapipe" and "megatron" with TeraPipe's
    slice-aware spec, and "megatron_local" (--megatron-local-spec) with Megatron's local spec.
    Each copy has its own config, so what TeraPipe configures on its own touches no other."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, use_cpu_initialization=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        hidden_dropout=0.0, attention_dropout=0.0)
    specs = {"terapipe": mt.get_gpt_layer_spec(), "megatron": mt.get_gpt_layer_spec()}
    if getattr(args, "megatron_local_spec", False):
        specs["megatron_local"] = get_gpt_layer_local_spec()
    models = {}
    for side, spec in specs.items():
        seed(args.device)
        model = GPTModel(copy.copy(config), spec, vocab_size=args.vocab_size,
                         max_sequence_length=args.seq_length, position_embedding_type="rope")
        models[side] = to_device(model, args.device)
    for side in specs:
        missing, _ = models[side].load_state_dict(models["terapipe"].state_dict(), strict=False)
        if any(not k.endswith("_extra_state") for k in missing):
            raise RuntimeError(f"the {side} model's spec differs in parameters: {missing}")
    return {side: in_precision(model.config, model) for side, model in models.items()}


def make_batch(args) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, args.vocab_size, (b, s + 1), generator=gen)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(b, s),
             "position_ids": torch.arange(s).expand(b, s), "attention_mask": None}
    return {k: (v.contiguous().to(args.device) if v is not None else None) for k, v in batch.items()}


def iteration(schedule: Callable, model: torch.nn.Module, batch: dict, args, **extra) -> None:
    # Graph replays accumulate into the captured .grad tensors, so they are zeroed in place.
    model.zero_grad(set_to_none=not args.cuda_graphs)
    schedule(forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
             num_microbatches=1, seq_length=args.seq_length,
             micro_batch_size=args.micro_batch_size, **extra)


def _timed(run: Callable[[], None], device: str) -> tuple[float, float]:
    """(iteration ms, host ms): CUDA events around the call on a GPU, the host clock on CPU."""
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        run()
        host = (time.perf_counter() - t0) * 1e3
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), host
    t0 = time.perf_counter()
    run()
    ms = (time.perf_counter() - t0) * 1e3
    return ms, ms


def _profile_cuda(run: Callable[[], None]) -> tuple[float, int, int]:
    """(kernel ms, kernel launches, syncs) of one iteration under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernel_us, launches, syncs = 0.0, 0, 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        elif event.name in LAUNCH_EVENTS:
            launches += 1
        if event.name in SYNC_EVENTS:
            syncs += 1
    # The profiler's own closing synchronize is not the iteration's.
    return kernel_us / 1e3, launches, max(0, syncs - 1)


def measure(name: str, attention: str, graphed: bool, slices: int, run: Callable[[], None],
            args) -> StageRow:
    for _ in range(args.warmup):
        run()
    timed = [_timed(run, args.device) for _ in range(args.iters)]
    times = [t for t, _ in timed]
    host = statistics.median(h for _, h in timed)
    if args.device == "cuda":
        busy, launches, syncs = _profile_cuda(run)
    else:
        with _OpCounter() as counter:
            run()
        busy, launches, syncs = None, counter.ops, counter.syncs
    return StageRow(name, ATTENTION[attention], graphed, slices, statistics.median(times), host, busy,
                    launches / slices, syncs / slices, times,
                    ops_per_iteration=launches if args.device == "cpu" else None)


def cell_graphs(plan, args) -> int:
    """How many graphs capturing each distinct cell of the plan once would take."""
    schedule = mt.build_schedule(plan, 1, 1, args.micro_batch_size)
    return len({(a.kind, a.cell.rows, a.cell.tokens, a.cell.context) for a in schedule.stages[0]})


def megatron_rows(models: dict, batch: dict, args) -> list[StageRow]:
    """Megatron's own schedule, unsliced, eager: on the slice-aware spec, and (when asked) on
    its local spec."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    rows = []
    for side, name, attention in (("megatron", "Megatron, unsliced (SDPA)", SDPA),
                                  ("megatron_local", "Megatron local spec, unsliced (unfused attention)",
                                   UNFUSED)):
        if side in models:
            model = models[side]
            rows.append(measure(name, attention, False, 1, lambda: iteration(
                forward_backward_no_pipelining, model, batch, args), args))
            print(_format(rows[-1]), flush=True)
    return rows


def run_all(args) -> list[StageRow]:
    models = build_models(args)
    ours = models["terapipe"]
    batch = make_batch(args)
    rows = megatron_rows(models, batch, args)
    for k in args.slice_counts:
        plan = mt.TeraPipePlan.uniform(args.seq_length, k)
        if args.defer_wgrad != "plan":
            plan = mt.TeraPipePlan(plan.seq_slices, defer_wgrad=args.defer_wgrad == "on")
        if args.cuda_graphs:
            use_cell_graphs(ours.config, plan, args.device)
        name = f"TeraPipe, {k} slices (SDPA)" + (", graphs" if args.cuda_graphs else "")
        rows.append(measure(name, SDPA, args.cuda_graphs, k, lambda: iteration(
            mt.forward_backward_terapipe, ours, batch, args, plan=plan), args))
        rows[-1].cell_graphs = cell_graphs(plan, args)
        print(_format(rows[-1]), flush=True)
    # Against TeraPipe's own 1-slice row only: same schedule, same attention, same graphs.
    terapipe = [r for r in rows if r.name.startswith("TeraPipe")]
    one = next((r.median_ms for r in terapipe if r.slices == 1), None)
    for r in terapipe:
        r.ratio_to_1_slice = r.median_ms / one if one else None
    return rows


def _format(r: StageRow) -> str:
    busy = f"{r.gpu_busy_ms:9.2f}" if r.gpu_busy_ms is not None else "        -"
    ratio = f"{r.ratio_to_1_slice:6.2f}x" if r.ratio_to_1_slice is not None else "      -"
    graphs = f"{r.cell_graphs:7d}" if r.cell_graphs is not None else "      -"
    return (f"{r.name:50s} {r.median_ms:10.2f} {r.host_ms:10.2f} {busy} "
            f"{r.launches_per_cell:11.1f} {r.syncs_per_cell:9.2f} {ratio} {graphs}")


def header(device: str) -> str:
    unit = "launches/cell" if device == "cuda" else "aten ops/cell"
    return (f"{'run':50s} {'median ms':>10s} {'host ms':>10s} {'GPU ms':>9s} "
            f"{unit:>11s} {'syncs/cell':>9s} {'vs 1':>7s} {'graphs':>7s}")


def main(argv=None) -> None:
    args = parse_args(argv)
    init_process(args.device)
    origin = provenance(script_command(__file__, argv))
    print(f"machine: {describe(origin)}", flush=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(header(args.device), flush=True)
    rows = run_all(args)
    print("\n" + header(args.device))
    for r in rows:
        print(_format(r))
    graphed = args.cuda_graphs and args.device == "cuda"
    out = args.out or default_out("stage_graphs.json" if graphed else "stage.json", args.device)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"provenance": origin, "device": args.device, "threads": torch.get_num_threads(),
                   "args": {k: v for k, v in vars(args).items() if k != "slice_counts"},
                   "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"> wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
