"""Measure one Megatron transformer layer on token slices, for ProfiledCostModel.

Each measured cell is a real slice: the layer (Megatron's GPT layer with our slice-aware core
attention, spec.py) first runs the `context` tokens as token slice 0 of a sequence, which fills
the K/V cache; then slice 1 of `length` tokens runs forward (timed) and backward (timed), reading
that cache exactly as the executor does. Imports torch and Megatron-Core lazily.

    python -m megatron_terapipe.planner.measure --hidden-size 1024 --num-attention-heads 16 \
        --seq-length 2048 --batch-sizes 1,2,4 --out layer_profile.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys
import time
from typing import Optional, Sequence

import numpy as np

from .cost_model import ModelDims
from .profiled import LayerMeasurements, Progress, default_grid, fit_layer_times


def _versions() -> dict:
    import torch

    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # pragma: no cover - source checkouts
        import megatron.core

        mcore = getattr(megatron.core, "__version__", "unknown")
    return {"torch_version": torch.__version__, "megatron_core_version": mcore}


def _ensure_parallel_state() -> None:
    """A one-process gloo group with TP=PP=1 unless the caller set up Megatron already."""
    import torch
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                             rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def measure_layer_times(model: ModelDims, cells: Optional[Sequence[tuple[int, int, int]]] = None,
                        seq_length: Optional[int] = None, batch_sizes: Sequence[int] = (1,),
                        granularity: int = 8, dtype: str = "bfloat16", device: Optional[str] = None,
                        repeats: int = 3, warmup: int = 1, progress: bool = True,
                        seed: int = 0, statistic: str = "min") -> LayerMeasurements:
    """Seconds of one layer's forward and backward on each (batch, length, context).

    statistic: "min" (default) keeps the fastest of `repeats` runs, since interference from
    other work only ever slows a run down; "median" keeps the median.
    cells: explicit (batch, length, context) list; otherwise `default_grid(seq_length,
    batch_sizes, granularity)`. dtype: "float32", "bfloat16" or "float16" (CPU: float32 or
    bfloat16). Tensor parallelism comes from Megatron's parallel state if the caller
    initialised it (run this under torchrun); otherwise one process, TP=1.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..attention import KVCache, running_cell
    from ..schedule import Cell
    from ..spec import get_gpt_layer_spec

    if cells is None:
        if seq_length is None:
            raise ValueError("measure_layer_times needs `cells` or `seq_length`")
        cells = default_grid(seq_length, batch_sizes, granularity)
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic must be 'min' or 'median', got {statistic!r}")
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    on_gpu = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if not on_gpu:
        from ..cpu import enable_cpu_mode

        enable_cpu_mode()
    _ensure_parallel_state()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    torch.manual_seed(seed)
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    config = TransformerConfig(
        num_layers=1, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn,
        gated_linear_unit=model.gated_linear_unit, tensor_model_parallel_size=tp,
        use_cpu_initialization=not on_gpu, params_dtype=torch_dtype, pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16, fp16=torch_dtype == torch.float16,
        hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_spec("auto" if on_gpu else "local")
    layer = build_module(spec, config=config, layer_number=1)
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    layer = layer.to(device=dev, dtype=torch_dtype)
    layer.train()

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def run(b: int, l: int, c: int) -> tuple[float, float]:
        cache = KVCache()
        n_slices = 2 if c else 1
        if c:
            first = Cell(0, 0, 0, 0, b, 0, c, n_slices)
            prefix = torch.randn(c, b, model.hidden_size, device=dev, dtype=torch_dtype)
            with running_cell(first, cache, "forward"):
                layer(prefix)  # fills the K/V cache the timed slice reads
        cell = Cell(0, 0, n_slices - 1, 0, b, c, l, n_slices)
        x = torch.randn(l, b, model.hidden_size, device=dev, dtype=torch_dtype, requires_grad=True)
        grad = torch.randn(l, b, model.hidden_size, device=dev, dtype=torch_dtype)
        sync()
        start = time.perf_counter()
        with running_cell(cell, cache, "forward"):
            out, _ = layer(x)
        sync()
        middle = time.perf_counter()
        cached = [len(v) for v in cache.entries.get(cell.sequence_key, {}).values()]
        if cached != [n_slices]:  # the timed slice must have read (and joined) the K/V cache
            raise RuntimeError("TeraPipe slice attention did not run in the measured layer: "
                               f"K/V cache holds {cached} slices, expected [{n_slices}]")
        with running_cell(cell, cache, "backward"):
            out.backward(grad)
        sync()
        end = time.perf_counter()
        layer.zero_grad(set_to_none=True)
        return middle - start, end - middle

    cells = [(int(b), int(l), int(c)) for b, l, c in cells]
    if cells:  # first calls pay one-off costs (allocator, kernel selection): run the largest once
        run(*max(cells, key=lambda cell: cell[0] * (cell[1] + cell[2])))
    # Rounds go over all cells, so a burst of outside load hits one sample of many cells rather
    # than every sample of one cell; the statistic over rounds then filters it out.
    bar = Progress(len(cells) * (warmup + repeats), "measuring layer", enabled=progress)
    samples = np.zeros((repeats, len(cells), 2))
    for round_ in range(-warmup, repeats):
        for i, (b, l, c) in enumerate(cells):
            times = run(b, l, c)
            if round_ >= 0:
                samples[round_, i] = times
            bar.step(f"round {round_ + warmup + 1}: b={b} l={l} c={c}")
    stat = samples.min(axis=0) if statistic == "min" else np.median(samples, axis=0)
    fwd, bwd = stat[:, 0], stat[:, 1]

    device_name = torch.cuda.get_device_name() if on_gpu else (platform.processor() or platform.machine() or "cpu")
    metadata = {
        "device": device_name, "device_type": "cuda" if on_gpu else "cpu", "dtype": dtype,
        "model": model.to_dict(), "model_name": model.name, "tensor_parallel": tp,
        "repeats": repeats, "warmup": warmup, "statistic": statistic, "threads": torch.get_num_threads(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **_versions(),
    }
    arr = np.array(cells, dtype=np.float64).reshape(-1, 3)
    return LayerMeasurements(arr[:, 0], arr[:, 1], arr[:, 2], np.array(fwd), np.array(bwd), metadata)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_terapipe.planner.measure",
                                description="Measure a Megatron layer on token slices and save a "
                                            "layer profile for terapipe-plan --profile.")
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--num-query-groups", type=int)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--batch-sizes", default="1", help="comma list, e.g. 1,2,4")
    p.add_argument("--granularity", type=int, default=8)
    p.add_argument("--points", type=int, default=6, help="lengths and contexts per axis")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True, help="profile JSON to write")
    args = p.parse_args(argv)
    try:
        model = ModelDims(num_layers=1, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads,
                          ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups)
        batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError as exc:
        p.error(str(exc))
    cells = default_grid(args.seq_length, batch_sizes, args.granularity, args.points)
    measurements = measure_layer_times(model, cells, dtype=args.dtype, repeats=args.repeats)
    fit = fit_layer_times(measurements)
    fit.save(args.out)
    err = fit.holdout_error
    if err:
        print(f"held-out error over {err['cells']} cells: forward mean "
              f"{100 * err['forward']['mean_relative']:.1f}% (max {100 * err['forward']['max_relative']:.1f}%), "
              f"backward mean {100 * err['backward']['mean_relative']:.1f}% "
              f"(max {100 * err['backward']['max_relative']:.1f}%)")
    print(f"profile: {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
