"""Measure one Megatron transformer layer on token slices, for ProfiledCostModel.

Each measured cell is a real slice: the layer (Megatron's GPT layer with our slice-aware core
attention, spec.py) first runs the `context` tokens as token slice 0 of a sequence, which fills
the K/V cache; then slice 1 of `length` tokens runs forward (timed) and backward (timed), reading
that cache exactly as the executor does. Context-free cells also run with deferred weight
gradients: the backward without them (timed) and the W action that computes them (timed), as the
executor runs them. Imports torch and Megatron-Core lazily.

With a vocabulary size it also measures the pipeline's edges on a few (batch, length) points
(measure_edge_times): the first stage's LanguageModelEmbedding, and the last stage's final layer
norm, output layer (ColumnParallelLinear hidden -> vocab, as GPTModel builds it) and loss
(vocab_parallel_cross_entropy and a masked sum, as pretrain_gpt's loss does).

    python -m megatron_terapipe.megatron.measure --hidden-size 1024 --num-attention-heads 16 \
        --seq-length 2048 --batch-sizes 1,2,4 --vocab-size 50304 --out layer_profile.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys
import time
from dataclasses import replace
from typing import Optional, Sequence

import numpy as np

from ..planner.cost_model import ModelDims
from ..planner.profiled import EdgeMeasurements, LayerMeasurements, Progress, default_grid, fit_layer_times

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
CACHE_FLUSH_BYTES = 8 << 20  # touched before each timed edge part on CPU (evicts L1/L2)


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


class _Device:
    """Device, dtype, parallel state and RNG set up for a measurement (CPU mode on CPU)."""

    def __init__(self, dtype: str, device: Optional[str], seed: int):
        import torch
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as tp_random

        self.dtype_name = dtype
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                      "float16": torch.float16}.get(dtype)
        if self.dtype is None:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        self.on_gpu = torch.cuda.is_available() if device is None else device.startswith("cuda")
        if not self.on_gpu:
            from .cpu import enable_cpu_mode

            enable_cpu_mode()
        _ensure_parallel_state()
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        torch.manual_seed(seed)
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.on_gpu
                       else torch.device("cpu"))

    def config(self, model: ModelDims):
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=1, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
            num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn,
            gated_linear_unit=model.gated_linear_unit, tensor_model_parallel_size=self.tp,
            use_cpu_initialization=not self.on_gpu, params_dtype=self.dtype, pipeline_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16,
            hidden_dropout=0.0, attention_dropout=0.0)

    def sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()

    def name(self) -> str:
        import torch

        if self.on_gpu:
            return torch.cuda.get_device_name()
        return platform.processor() or platform.machine() or "cpu"

    def metadata(self, repeats: int, warmup: int, statistic: str) -> dict:
        import torch

        return {"device": self.name(), "device_type": "cuda" if self.on_gpu else "cpu",
                "dtype": self.dtype_name, "tensor_parallel": self.tp, "repeats": repeats,
                "warmup": warmup, "statistic": statistic, "threads": torch.get_num_threads(),
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                **_versions()}


def _check_repeats(repeats: int, statistic: str) -> None:
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic must be 'min' or 'median', got {statistic!r}")
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")


def _check_position_type(kind: str) -> None:
    if kind not in POSITION_EMBEDDING_TYPES:
        raise ValueError(f"position_embedding_type must be one of "
                         f"{', '.join(POSITION_EMBEDDING_TYPES)}, got {kind!r}")


def _timed_rounds(points: list, run, repeats: int, warmup: int, statistic: str, label: str,
                  progress: bool, settle: int = 0) -> np.ndarray:
    """[len(points), outputs] statistic over rounds of run(*point); each round visits every
    point, so a burst of outside load hits one sample of many points, not every sample of one.
    settle: untimed runs of a point right before its timed run in every round."""
    bar = Progress(len(points) * (warmup + repeats), label, enabled=progress)
    samples = None
    for round_ in range(-warmup, repeats):
        for i, point in enumerate(points):
            for _ in range(settle):
                run(*point)
            times = run(*point)
            if samples is None:
                samples = np.zeros((repeats, len(points), len(times)))
            if round_ >= 0:
                samples[round_, i] = times
            bar.step(f"round {round_ + warmup + 1}: " + " ".join(
                f"{k}={v}" for k, v in zip("blc", point)))
    if samples is None:
        return np.zeros((0, 0))
    return samples.min(axis=0) if statistic == "min" else np.median(samples, axis=0)


def edge_points_for(cells: Sequence[tuple[int, int, int]], count: int = 4) -> list[tuple[int, int]]:
    """(batch, length) points for the edges from a layer grid: every batch size, at up to
    `count` of its lengths spread from the shortest to the longest."""
    points = []
    for b in sorted({int(c[0]) for c in cells}):
        lengths = sorted({int(c[1]) for c in cells if int(c[0]) == b})
        spread = np.linspace(0, len(lengths) - 1, min(count, len(lengths)))
        picks = sorted({int(round(x)) for x in spread})
        points += [(b, lengths[i]) for i in picks]
    return points


def measure_edge_times(model: ModelDims, points: Optional[Sequence[tuple[int, int]]] = None,
                       vocab_size: Optional[int] = None,
                       position_embedding_type: str = "learned_absolute",
                       max_sequence_length: Optional[int] = None,
                       seq_length: Optional[int] = None, batch_sizes: Sequence[int] = (1,),
                       granularity: int = 8, dtype: str = "bfloat16", device: Optional[str] = None,
                       repeats: int = 3, warmup: int = 1, progress: bool = True, seed: int = 0,
                       statistic: str = "min") -> EdgeMeasurements:
    """Seconds of the pipeline's edges, forward and backward, on (batch, length) points:

    embedding: Megatron's LanguageModelEmbedding (word embeddings, plus learned absolute
        positions if position_embedding_type is "learned_absolute"), as on the first stage;
    output: the final layer norm, the output layer (ColumnParallelLinear hidden -> vocab,
        bias-free, parallel output, as GPTModel builds it), vocab_parallel_cross_entropy and
        the masked sum of pretrain_gpt's loss, as on the last stage (its backward includes the
        gradient of its input, which goes back to the previous stage).

    vocab_size: default model.vocab_size (one of them is required); with TP > 1 it must divide
    by the TP size (give Megatron's padded size). points: default every batch size with 4
    lengths from `granularity` to `seq_length`. max_sequence_length: rows of the position table
    (default the longest point). Parameter gradients accumulate over the runs as they do over
    the cells of an iteration. Other arguments as for measure_layer_times.
    """
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import LayerNormImpl

    V = vocab_size if vocab_size is not None else model.vocab_size
    if V is None or int(V) <= 0:
        raise ValueError("measuring the edges needs a positive vocab_size (argument or ModelDims)")
    V = int(V)
    _check_position_type(position_embedding_type)
    if points is None:
        if seq_length is None:
            raise ValueError("measure_edge_times needs `points` or `seq_length`")
        lengths = sorted({int(min(seq_length, max(granularity, granularity * round(x / granularity))))
                          for x in np.geomspace(granularity, max(granularity, seq_length), 4)})
        points = [(int(b), l) for b in batch_sizes for l in lengths]
    points = [(int(b), int(l)) for b, l in points]
    if not points or any(b <= 0 or l <= 0 for b, l in points):
        raise ValueError(f"edge points must be positive (batch, length) pairs, got {points}")
    _check_repeats(repeats, statistic)
    max_seq = int(max_sequence_length or max(l for _, l in points))
    if max_seq < max(l for _, l in points):
        raise ValueError(f"max_sequence_length {max_seq} is shorter than the longest point")
    env = _Device(dtype, device, seed)
    if V % env.tp:
        raise ValueError(f"vocab_size {V} is not divisible by the tensor-parallel size {env.tp}: "
                         "give the padded vocabulary size")
    config = env.config(model)
    dev, dt, h = env.device, env.dtype, model.hidden_size
    embedding = LanguageModelEmbedding(config=config, vocab_size=V, max_sequence_length=max_seq,
                                       position_embedding_type=position_embedding_type)
    final_norm = build_module(LayerNormImpl, config=config, hidden_size=h, eps=config.layernorm_epsilon)
    output_layer = tensor_parallel.ColumnParallelLinear(
        h, V, config=config, init_method=config.init_method, bias=False, skip_bias_add=False,
        gather_output=False)
    modules = [m.to(device=dev, dtype=dt) for m in (embedding, final_norm, output_layer)]
    for m in modules:
        m.train()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # In a pipeline stage, transformer layers run between an edge part and the next one, so the
    # edge's weights are not in the CPU's caches. Evict them before each timed part, or a part
    # would run warm or cold depending on what was measured just before it.
    scratch = None if env.on_gpu else torch.zeros(CACHE_FLUSH_BYTES // 4)

    def cold() -> None:
        if scratch is not None:
            scratch.add_(1.0)

    def run(b: int, l: int) -> tuple[float, float, float, float]:
        ids = torch.randint(0, V, (b, l), generator=gen).to(dev)
        positions = torch.arange(l).unsqueeze(0).expand(b, -1).contiguous().to(dev)
        grad = torch.randn(l, b, h, generator=gen).to(device=dev, dtype=dt)
        hidden = torch.randn(l, b, h, generator=gen).to(device=dev, dtype=dt).requires_grad_(True)
        labels = torch.randint(0, V, (b, l), generator=gen).to(dev)
        loss_mask = (torch.rand(b, l, generator=gen) > 0.25).float().to(dev)
        cold()
        env.sync()
        t0 = time.perf_counter()
        emb = embedding(input_ids=ids, position_ids=positions)  # [l, b, h]
        env.sync()
        t1 = time.perf_counter()
        cold()
        t2 = time.perf_counter()
        emb.backward(grad)
        env.sync()
        t3 = time.perf_counter()
        cold()
        t4 = time.perf_counter()
        logits, _ = output_layer(final_norm(hidden))  # [l, b, V / tp]
        # GPTModel.compute_language_model_loss: [b, l] labels in, [b, l] losses out
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
        losses = losses.transpose(0, 1).contiguous()
        loss = torch.sum(losses.float().view(-1) * loss_mask.view(-1))  # pretrain_gpt's loss_func
        env.sync()
        t5 = time.perf_counter()
        cold()
        t6 = time.perf_counter()
        loss.backward()
        env.sync()
        t7 = time.perf_counter()
        return t1 - t0, t3 - t2, t5 - t4, t7 - t6

    run(*max(points, key=lambda p: p[0] * p[1]))  # one-off costs, and the gradients exist
    # settle=1: on CPU the first run of a shape after a much larger one is up to 2x slower for
    # small shapes (seen at hidden 64: 190 vs 117 us), a transient a steady pipeline of
    # similar cells does not see; each timed run follows an untimed run of the same shape.
    stat = _timed_rounds(points, run, repeats, warmup, statistic, "measuring edges", progress,
                         settle=1)
    arr = np.array(points, dtype=np.float64)
    metadata = {"vocab_size": V, "position_embedding_type": position_embedding_type,
                "max_sequence_length": max_seq, "hidden_size": h,
                "output_includes": "final layer norm, output layer, cross entropy, masked sum",
                **env.metadata(repeats, warmup, statistic)}
    return EdgeMeasurements(arr[:, 0], arr[:, 1], stat[:, 0], stat[:, 1], stat[:, 2], stat[:, 3],
                            metadata)


def measure_layer_times(model: ModelDims, cells: Optional[Sequence[tuple[int, int, int]]] = None,
                        seq_length: Optional[int] = None, batch_sizes: Sequence[int] = (1,),
                        granularity: int = 8, dtype: str = "bfloat16", device: Optional[str] = None,
                        repeats: int = 3, warmup: int = 1, progress: bool = True,
                        seed: int = 0, statistic: str = "min", vocab_size: Optional[int] = None,
                        position_embedding_type: str = "learned_absolute",
                        edges: bool = True) -> LayerMeasurements:
    """Seconds of one layer's forward and backward on each (batch, length, context), and on
    context-free cells also the backward with deferred weight gradients and its W action (the
    weight-gradient GEMMs alone; NaN on cells with context, which W does not depend on).

    statistic: "min" (default) keeps the fastest of `repeats` runs, since interference from
    other work only ever slows a run down; "median" keeps the median.
    cells: explicit (batch, length, context) list; otherwise `default_grid(seq_length,
    batch_sizes, granularity)`. dtype: "float32", "bfloat16" or "float16" (CPU: float32 or
    bfloat16). Tensor parallelism comes from Megatron's parallel state if the caller
    initialised it (run this under torchrun); otherwise one process, TP=1.

    Edges: when a vocabulary size is known (`vocab_size`, else `model.vocab_size`) and `edges`
    is true, the embedding and the output layer + loss are measured too (measure_edge_times,
    at every batch size and up to 4 of the grid's lengths, position table as long as the
    longest cell) and returned in `.edges`; fit_layer_times then fits them into the profile.
    """
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from ..runtime.attention import KVCache, running_cell
    from ..schedule import Cell
    from .spec import get_gpt_layer_spec
    from ..runtime.wgrad import WeightGradStore, install_wgrad_deferral

    if cells is None:
        if seq_length is None:
            raise ValueError("measure_layer_times needs `cells` or `seq_length`")
        cells = default_grid(seq_length, batch_sizes, granularity)
    _check_repeats(repeats, statistic)
    V = vocab_size if vocab_size is not None else model.vocab_size
    if edges and V is not None:
        _check_position_type(position_embedding_type)
    env = _Device(dtype, device, seed)
    on_gpu, dev, torch_dtype = env.on_gpu, env.device, env.dtype
    config = env.config(model)
    spec = get_gpt_layer_spec("auto" if on_gpu else "local")
    layer = build_module(spec, config=config, layer_number=1)
    layer = layer.to(device=dev, dtype=torch_dtype)
    layer.train()
    deferrable = install_wgrad_deferral(layer)
    sync = env.sync

    def run(b: int, l: int, c: int) -> tuple[float, float, float, float]:
        forward, backward, _ = run_cell(b, l, c)
        if c:  # weight gradients do not depend on the context: measured on context-free cells
            return forward, backward, float("nan"), float("nan")
        # the same cell again, its weight gradients deferred as the executor does: the backward
        # without them, then the W action that computes them
        _, deferred_backward, wgrad = run_cell(b, l, 0, WeightGradStore())
        return forward, backward, deferred_backward, wgrad

    def run_cell(b: int, l: int, c: int, store: Optional[WeightGradStore] = None
                 ) -> tuple[float, float, float]:
        """Forward and backward seconds of the cell, and with a store its W action's."""
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
        with running_cell(cell, cache, "forward", wgrad=store):
            out, _ = layer(x)
        sync()
        middle = time.perf_counter()
        cached = [len(v) for v in cache.entries.get(cell.sequence_key, {}).values()]
        if cached != [n_slices]:  # the timed slice must have read (and joined) the K/V cache
            raise RuntimeError("TeraPipe slice attention did not run in the measured layer: "
                               f"K/V cache holds {cached} slices, expected [{n_slices}]")
        with running_cell(cell, cache, "backward", wgrad=store):
            out.backward(grad)
        sync()
        end = time.perf_counter()
        if store is None:
            # Gradients stay: in an iteration every cell after the first adds into them, which
            # costs more than writing fresh ones.
            return middle - start, end - middle, 0.0
        if store.deferred != deferrable:  # every local linear layer must have deferred
            raise RuntimeError(f"weight-gradient deferral did not run in the measured layer: "
                               f"{store.deferred} of {deferrable} linear layers deferred")
        store.flush(cell.sequence_key)
        sync()
        return middle - start, end - middle, time.perf_counter() - end

    cells = [(int(b), int(l), int(c)) for b, l, c in cells]
    if cells:  # first calls pay one-off costs (allocator, kernel selection): run the largest once
        run(*max(cells, key=lambda cell: cell[0] * (cell[1] + cell[2])))
    stat = _timed_rounds(cells, run, repeats, warmup, statistic, "measuring layer", progress)
    fwd, bwd, deferred_bwd, wgrad = (stat.T if len(cells) else np.zeros((4, 0)))

    measured_model = model if V is None else replace(model, vocab_size=int(V))
    metadata = {"model": measured_model.to_dict(), "model_name": model.name,
                "wgrad_deferring_linear_layers": deferrable,
                **env.metadata(repeats, warmup, statistic)}
    edge_measurements = None
    if edges and V is not None and cells:
        edge_measurements = measure_edge_times(
            model, edge_points_for(cells), vocab_size=int(V),
            position_embedding_type=position_embedding_type,
            max_sequence_length=max(l + c for _, l, c in cells), dtype=dtype, device=device,
            repeats=repeats, warmup=warmup, progress=progress, seed=seed, statistic=statistic)
    arr = np.array(cells, dtype=np.float64).reshape(-1, 3)
    return LayerMeasurements(arr[:, 0], arr[:, 1], arr[:, 2], np.array(fwd), np.array(bwd), metadata,
                             edge_measurements, deferred_backward=np.array(deferred_bwd),
                             wgrad=np.array(wgrad))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_terapipe.megatron.measure",
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
    p.add_argument("--vocab-size", type=int,
                   help="also measure the embedding and the output layer + loss (the first and "
                        "last stage's edges) with this vocabulary (Megatron's padded size)")
    p.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=POSITION_EMBEDDING_TYPES,
                   help="for the embedding (default learned_absolute, as Megatron's GPTModel)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    args = p.parse_args(argv)
    try:
        model = ModelDims(num_layers=1, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads,
                          ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups,
                          vocab_size=args.vocab_size)
        batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError as exc:
        p.error(str(exc))
    cells = default_grid(args.seq_length, batch_sizes, args.granularity, args.points)
    measurements = measure_layer_times(model, cells, dtype=args.dtype, repeats=args.repeats,
                                       position_embedding_type=args.position_embedding_type)
    fit = fit_layer_times(measurements)
    fit.save(args.out)
    err = fit.holdout_error
    if err:
        print(f"held-out error over {err['cells']} cells: forward mean "
              f"{100 * err['forward']['mean_relative']:.1f}% (max {100 * err['forward']['max_relative']:.1f}%), "
              f"backward mean {100 * err['backward']['mean_relative']:.1f}% "
              f"(max {100 * err['backward']['max_relative']:.1f}%)")
    if fit.has_wgrad:
        m = measurements
        measured = np.flatnonzero(np.isfinite(m.wgrad))
        i = measured[np.argmax(m.batch[measured] * m.length[measured])]  # the most tokens
        print(f"deferred weight gradients at {int(m.batch[i])}x{int(m.length[i])} tokens: backward "
              f"{1e3 * m.backward[i]:.2f} ms; without them {1e3 * m.deferred_backward[i]:.2f} ms, "
              f"then a W action of {1e3 * m.wgrad[i]:.2f} ms")
    if fit.edges is not None:
        tokens = int(max(measurements.edges.batch * measurements.edges.length))
        parts = [f"{part} {1e3 * fit.edges.seconds(part, 'forward', 1, tokens):.2f} + "
                 f"{1e3 * fit.edges.seconds(part, 'backward', 1, tokens):.2f} ms"
                 for part in ("embedding", "output")]
        print(f"edges at {tokens} tokens (forward + backward): {parts[0]}; {parts[1]} "
              f"(output layer and loss)")
    print(f"profile: {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
