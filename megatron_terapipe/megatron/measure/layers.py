"""Measure one Megatron transformer layer on token slices, for ProfiledCostModel.

Each measured cell is a real slice: the layer (Megatron's GPT layer with our slice-aware core
attention, model/layer_specs.py) first runs the `context` tokens as token slice 0 of a sequence, which fills
the K/V cache; then slice 1 of `length` tokens runs forward (timed) and backward (timed), reading
that cache exactly as the executor does. Context-free cells also run with deferred weight
gradients: the backward without them (timed) and the W action that computes them (timed), as the
executor runs them. With a vocabulary size the pipeline's edges are measured too
(edges.py). Megatron-Core is imported lazily.

    python -m megatron_terapipe.megatron.measure layers --hidden-size 1024 --num-attention-heads 16 \\
        --seq-length 2048 --batch-sizes 1,2,4 --vocab-size 50304 --out layer_profile.json
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import numpy as np
import torch

from ...planner.cost.dims import ModelDims
from ...planner.profile.time_fit import LayerTimeFit
from ...planner.profile.time_samples import LayerMeasurements, default_grid
from ...runtime.context import running_cell
from ...runtime.attention.kv_cache import KVCache
from ...runtime.wgrad.store import WeightGradStore
from ...schedule import Cell
from ..model.param_deferral import install_wgrad_deferral
from .clocks import clock_metadata, make_clock
from .device_setup import MeasureDevice, check_position_type, check_repeats, timed_rounds
from .edges import edge_points_for, measure_edge_times
from ..model.layer_specs import get_gpt_layer_spec

Seconds = tuple[float, float, float, float]  # forward, backward, deferred backward, W


class _SliceLayer:
    """One GPT layer with slice-aware attention and deferrable weight gradients, run on a
    real token slice per call."""

    def __init__(self, env: MeasureDevice, model: ModelDims, clock):
        from megatron.core.transformer.spec_utils import build_module

        self.env, self.hidden, self.clock = env, model.hidden_size, clock
        config = env.config(model)
        spec = get_gpt_layer_spec("auto" if env.on_gpu else "local")
        self.layer = build_module(spec, config=config, layer_number=1)
        self.layer = self.layer.to(device=env.device, dtype=env.dtype)
        self.layer.train()
        self.deferrable = install_wgrad_deferral(self.layer)

    def run(self, b: int, l: int, c: int) -> Seconds:
        forward, backward, _ = self.run_cell(b, l, c)
        if c:  # weight gradients do not depend on the context: measured on context-free cells
            return forward, backward, float("nan"), float("nan")
        # the same cell again, its weight gradients deferred as the executor does: the backward
        # without them, then the W action that computes them
        _, deferred_backward, wgrad = self.run_cell(b, l, 0, defer=True)
        return forward, backward, deferred_backward, wgrad

    def run_cell(self, b: int, l: int, c: int, defer: bool = False) -> tuple[float, float, float]:
        """Forward and backward seconds of the cell, and deferring its weight gradients its W
        action's (each try of a device clock on a fresh store: it counts what it received)."""
        return self.clock.retried(
            lambda: self._timed_cell(b, l, c, WeightGradStore() if defer else None))

    def _timed_cell(self, b: int, l: int, c: int, store: Optional[WeightGradStore]
                    ) -> tuple[float, float, float]:
        dev, dt, clock = self.env.device, self.env.dtype, self.clock
        cache = KVCache()
        # The timed slice is one of two (after c tokens, or first): the K/V cache's path, which
        # every slice of a sliced sequence takes (a whole sequence skips it: priced a bit high).
        if c:
            prefix = torch.randn(c, b, self.hidden, device=dev, dtype=dt)
            with running_cell(Cell(0, 0, 0, 0, b, 0, c, 2), cache, "forward"):
                self.layer(prefix)  # fills the K/V cache the timed slice reads
        n_slices = 2 if c else 1  # slices in the cache once the timed one ran
        cell = Cell(0, 0, n_slices - 1, 0, b, c, l, 2)
        x = torch.randn(l, b, self.hidden, device=dev, dtype=dt, requires_grad=True)
        grad = torch.randn(l, b, self.hidden, device=dev, dtype=dt)
        clock.begin()
        with running_cell(cell, cache, "forward", wgrad=store):
            out, _ = self.layer(x)
        clock.mark()
        cached = [len(v) for v in cache.entries.get(cell.sequence_key, {}).values()]
        if cached != [n_slices]:  # the timed slice must have read (and joined) the K/V cache
            raise RuntimeError("TeraPipe slice attention did not run in the measured layer: "
                               f"K/V cache holds {cached} slices, expected [{n_slices}]")
        with running_cell(cell, cache, "backward", wgrad=store):
            out.backward(grad)
        clock.mark()
        if store is None:
            # Gradients stay: in an iteration every cell after the first adds into them, which
            # costs more than writing fresh ones.
            forward, backward = clock.spans()
            return forward, backward, 0.0
        if store.deferred != self.deferrable:  # every deferrable parameter must have deferred
            raise RuntimeError(f"gradient deferral did not run in the measured layer: "
                               f"{store.deferred} of {self.deferrable} parameters deferred")
        store.flush(cell.sequence_key)
        clock.mark()
        forward, backward, wgrad = clock.spans()
        return forward, backward, wgrad


def measure_layer_times(model: ModelDims, cells: Optional[Sequence[tuple[int, int, int]]] = None,
                        seq_length: Optional[int] = None, batch_sizes: Sequence[int] = (1,),
                        granularity: int = 8, dtype: str = "bfloat16", device: Optional[str] = None,
                        repeats: int = 3, warmup: int = 1, progress: bool = True,
                        seed: int = 0, statistic: str = "min", vocab_size: Optional[int] = None,
                        position_embedding_type: str = "learned_absolute",
                        edges: bool = True, timing: str = "wall") -> LayerMeasurements:
    """Seconds of one layer's forward and backward on each (batch, length, context), and on
    context-free cells also the backward with deferred weight gradients and its W action (the
    weight-gradient GEMMs alone; NaN on cells with context, which W does not depend on).

    statistic: "min" (default) keeps the fastest of `repeats` runs, since interference from
    other work only ever slows a run down; "median" keeps the median. timing: "wall" (default)
    the host's time with the device synchronised, what an eager cell costs; "device" the GPU's
    time with the host's launches queued ahead, what a CUDA-graphed cell costs (clocks.py).
    cells: explicit (batch, length, context) list; otherwise `default_grid(seq_length,
    batch_sizes, granularity)`. dtype: "float32", "bfloat16" or "float16" (CPU: float32 or
    bfloat16). Tensor parallelism comes from Megatron's parallel state if the caller
    initialised it (run this under torchrun); otherwise one process, TP=1.

    Edges: when a vocabulary size is known (`vocab_size`, else `model.vocab_size`) and `edges`
    is true, the embedding and the output layer + loss are measured too (measure_edge_times,
    at every batch size and up to 4 of the grid's lengths, position table as long as the
    longest cell) and returned in `.edges`; fit_layer_times then fits them into the profile.
    """
    if cells is None:
        if seq_length is None:
            raise ValueError("measure_layer_times needs `cells` or `seq_length`")
        cells = default_grid(seq_length, batch_sizes, granularity)
    check_repeats(repeats, statistic, timing)
    V = vocab_size if vocab_size is not None else model.vocab_size
    if edges and V is not None:
        check_position_type(position_embedding_type)
    env = MeasureDevice(dtype, device, seed)
    layer = _SliceLayer(env, model, make_clock(timing, env.sync, env.on_gpu))
    cells = [(int(b), int(l), int(c)) for b, l, c in cells]
    if cells:  # first calls pay one-off costs (allocator, kernel selection): run the largest once
        layer.run(*max(cells, key=lambda cell: cell[0] * (cell[1] + cell[2])))
    stat = timed_rounds(cells, layer.run, repeats, warmup, statistic, "measuring layer", progress)
    fwd, bwd, deferred_bwd, wgrad = (stat.T if len(cells) else np.zeros((4, 0)))

    measured_model = model if V is None else replace(model, vocab_size=int(V))
    metadata = {"model": measured_model.to_dict(), "model_name": model.name,
                "wgrad_deferring_parameters": layer.deferrable,
                **env.metadata(repeats, warmup, statistic, timing), **clock_metadata(layer.clock)}
    edge_measurements = None
    if edges and V is not None and cells:
        edge_measurements = measure_edge_times(
            model, edge_points_for(cells), vocab_size=int(V),
            position_embedding_type=position_embedding_type,
            max_sequence_length=max(l + c for _, l, c in cells), dtype=dtype, device=device,
            repeats=repeats, warmup=warmup, progress=progress, seed=seed, statistic=statistic,
            timing=timing)
    arr = np.array(cells, dtype=np.float64).reshape(-1, 3)
    return LayerMeasurements(arr[:, 0], arr[:, 1], arr[:, 2], np.array(fwd), np.array(bwd), metadata,
                             edge_measurements, deferred_backward=np.array(deferred_bwd),
                             wgrad=np.array(wgrad))


def summary_lines(fit: LayerTimeFit, m: LayerMeasurements) -> list[str]:
    """What a measured profile says in brief: held-out error, the W action, the edges."""
    lines = []
    err = fit.holdout_error
    if err:
        fwd, bwd = err["forward"], err["backward"]
        lines.append(f"held-out error over {err['cells']} cells: forward mean "
                     f"{100 * fwd['mean_relative']:.1f}% (max {100 * fwd['max_relative']:.1f}%), "
                     f"backward mean {100 * bwd['mean_relative']:.1f}% "
                     f"(max {100 * bwd['max_relative']:.1f}%)")
    if fit.has_wgrad:
        measured = np.flatnonzero(np.isfinite(m.wgrad))
        i = measured[np.argmax(m.batch[measured] * m.length[measured])]  # the most tokens
        lines.append(f"deferred weight gradients at {int(m.batch[i])}x{int(m.length[i])} tokens: "
                     f"backward {1e3 * m.backward[i]:.2f} ms; without them "
                     f"{1e3 * m.deferred_backward[i]:.2f} ms, then a W action of "
                     f"{1e3 * m.wgrad[i]:.2f} ms")
    held = m.metadata.get("device_clock")
    if held:
        lines.append(f"device clock: {held['regions']} timed regions, {held['reruns']} rerun after "
                     f"a short hold, largest hold {held['largest_hold_cycles']} GPU cycles")
    if fit.edges is not None:
        tokens = int(max(m.edges.batch * m.edges.length))
        parts = [f"{part} {1e3 * fit.edges.seconds(part, 'forward', 1, tokens):.2f} + "
                 f"{1e3 * fit.edges.seconds(part, 'backward', 1, tokens):.2f} ms"
                 for part in ("embedding", "output")]
        lines.append(f"edges at {tokens} tokens (forward + backward): {parts[0]}; {parts[1]} "
                     f"(output layer and loss)")
    return lines
