"""Measure what a pipeline stage keeps for backward, for the planner's FittedMemory.

Stage models are built as the pipeline builds them (Megatron's GPTModel with TeraPipe's slice
attention): one and two layers without edges, one layer after the embedding, one layer before
the output layer and loss. Each runs real token slices, as the executor runs them, under the
meter the tests use (runtime/memory/buffer_bytes.py: autograd's saved tensors, K/V gradient buffers
and deferred weight-gradient pieces), and the bytes each slice adds are recorded; whole
microbatches without cells (what Megatron's own schedules keep) and what a deferred backward
leaves for the W action too. planner/profile/memory_fit.py fits them.

    python -m megatron_terapipe.megatron.measure memory --hidden-size 512 \\
        --num-attention-heads 8 --seq-length 2048 --vocab-size 1024 --dtype float32 \\
        --position-embedding-type rope --out memory_profile.json
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import replace
from typing import Callable, Iterator, Optional

from ...planner.cost.dims import ModelDims
from ...planner.profile.memory_fit import MemoryMeasurements
from ...schedule import Cell
from .device_setup import MeasureDevice, check_position_type

#: stage kind -> (layers, first stage, last stage)
STAGE_KINDS = {"layers1": (1, False, False), "layers2": (2, False, False),
               "first1": (1, True, False), "last1": (1, False, True)}


def memory_cells(seq_length: int, granularity: int = 8) -> list[tuple[int, int, int]]:
    """(rows, tokens, context): 1 and 2 rows, slices of a and 2a tokens after 0, a and 3a
    tokens of context (a an eighth of the sequence, a multiple of the granularity)."""
    a = max(granularity, (seq_length // 8) // granularity * granularity)
    return [(r, t, c) for r in (1, 2) for t in (a, 2 * a) for c in (0, a, 3 * a)
            if t + c <= seq_length]


@contextlib.contextmanager
def _on_first_kv_grad(callback: Callable[[], None]) -> Iterator[None]:
    """Call `callback` when the first K/V gradient buffer is about to be allocated."""
    from ...runtime.attention.kv_cache import KVBuffer

    original, called = KVBuffer.grad, []

    def grad(buf, which, like):
        if not called and getattr(buf, "grad_" + which) is None:
            called.append(True)
            callback()
        return original(buf, which, like)

    KVBuffer.grad = grad
    try:
        yield
    finally:
        KVBuffer.grad = original


class _Stage:
    """One stage model and how to run a cell, a backward, or a whole microbatch on it."""

    def __init__(self, env: MeasureDevice, model: ModelDims, kind: str, vocab_size: int,
                 seq_length: int, position_embedding_type: str):
        from megatron.core.models.gpt import GPTModel

        from ..model.param_deferral import install_wgrad_deferral
        from ..model.layer_specs import get_gpt_layer_spec

        self.layers, self.first, self.last = STAGE_KINDS[kind]
        config = env.config(model)
        config.num_layers = self.layers
        self.env, self.hidden, self.vocab = env, model.hidden_size, vocab_size
        self.model = GPTModel(config, get_gpt_layer_spec("auto" if env.on_gpu else "local"),
                              vocab_size=vocab_size, max_sequence_length=seq_length,
                              pre_process=self.first, post_process=self.last,
                              position_embedding_type=position_embedding_type,
                              share_embeddings_and_output_weights=False)
        self.model.to(device=env.device, dtype=env.dtype).train()
        install_wgrad_deferral(self.model)
        self.params = tuple(self.model.parameters())

    def forward(self, rows: int, start: int, tokens: int):
        """The stage on tokens [start, start + tokens) of `rows` sequences; returns the root
        of its backward (the loss on the last stage, else the output) and its gradient."""
        import torch

        dev = self.env.device
        ids = torch.randint(0, self.vocab, (rows, tokens), device=dev)
        positions = torch.arange(start, start + tokens, device=dev).unsqueeze(0).expand(rows, -1)
        if not self.first:
            x = torch.randn(tokens, rows, self.hidden, device=dev, dtype=self.env.dtype,
                            requires_grad=True)
            self.model.set_input_tensor(x)
        labels = torch.randint(0, self.vocab, (rows, tokens), device=dev) if self.last else None
        out = self.model(ids, positions.contiguous(), None, labels=labels)
        if self.last:  # pretrain_gpt's loss: the masked sum of the per-token losses
            mask = (torch.rand(rows, tokens, device=dev) > 0.25).float()
            return torch.sum(out.float().view(-1) * mask.view(-1)), None
        return out, torch.randn_like(out)


def _slice_bytes(stage: _Stage, meter, r: int, t: int, c: int) -> float:
    """Bytes the slice of t tokens after c tokens of context adds (its K/V buffers apart)."""
    from ...runtime.context import running_cell
    from ...runtime.attention.kv_cache import KVCache

    gc.collect()  # what earlier runs left behind goes now, not during this one
    cache, kept = KVCache(seq_length=t + c), []
    if c:
        with running_cell(Cell(0, 0, 0, 0, r, 0, c, 2), cache, "forward"):
            kept.append(stage.forward(r, 0, c))
    before = meter.live_bytes
    # one of two slices: the K/V buffers' path (a sequence of one slice has none)
    with running_cell(Cell(0, 0, 1 if c else 0, 0, r, c, t, 2), cache, "forward"):
        kept.append(stage.forward(r, c, t))  # its graph stays while we read the meter
    return float(meter.live_bytes - before - (cache.live_bytes() if c == 0 else 0))


def _first_backward(stage: _Stage, meter, r: int, t: int, deferred: bool) -> dict[str, float]:
    """A first slice of t tokens run alone, forward and backward (weight gradients deferred or
    not): its K/V buffer bytes per row, token and layer, the share of its activations the
    backward freed before the first K/V gradient buffer, and what it left for the W action.
    The share is the smaller of what was gone when the first K/V gradient buffer came and what
    the backward's highest point leaves for the planner's walk, which puts the peak right
    after the K/V gradients (the input-gradient GEMMs' outputs and the pieces kept for the W
    action can top it later in the layer)."""
    from ...runtime.context import running_cell
    from ...runtime.attention.kv_cache import KVCache
    from ...runtime.wgrad.store import WeightGradStore

    gc.collect()
    cache, store = KVCache(seq_length=t), WeightGradStore() if deferred else None
    # one of two slices: the K/V buffers' path (a sequence of one slice has none)
    cell, start = Cell(0, 0, 0, 0, r, 0, t, 2), meter.live_bytes
    with running_cell(cell, cache, "forward", wgrad=store):
        root, grad = stage.forward(r, 0, t)
    buffers = cache.live_bytes()
    activations = meter.live_bytes - start - buffers
    before, at_first_grad = meter.live_bytes, []
    meter.peak_bytes = before
    with running_cell(cell, cache, "backward", wgrad=store), \
            _on_first_kv_grad(lambda: at_first_grad.append(meter.live_bytes)):
        root.backward(grad)
    # the K/V gradient buffers are as large as the K/V buffers
    at_peak = (before + buffers - meter.peak_bytes) / activations
    cache.release_slice(cell)
    held = meter.live_bytes - start
    if store is not None:
        store.flush(cell.sequence_key)
    freed = (before - at_first_grad[0]) / activations if at_first_grad else 0.0
    return {"kv_per_token": buffers / (stage.layers * r * t), "held": float(held),
            "freed": min(freed, at_peak)}


def _measure_kind(stage: _Stage, cells, meter, wholes, freed: dict[str, list[float]]
                  ) -> tuple[list, list, list, float]:
    """Bytes per cell (K/V buffers apart), per deferred backward, per whole microbatch; and
    K/V buffer bytes per row, token and layer. On a one-layer middle stage, appends to
    `freed` (plain, deferred) the share of a cell's activations its backward freed before it
    allocated its K/V gradients."""
    cell_rows = [(r, t, c, _slice_bytes(stage, meter, r, t, c)) for r, t, c in cells]
    hold_rows, kv_per_token = [], 0.0
    middle = stage.layers == 1 and not (stage.first or stage.last)
    for r, t in sorted({(r, t) for r, t, c in cells}):
        deferred = _first_backward(stage, meter, r, t, True)
        hold_rows.append((r, t, deferred["held"]))
        kv_per_token = deferred["kv_per_token"]
        if middle:
            freed["deferred"].append(deferred["freed"])
            freed["plain"].append(_first_backward(stage, meter, r, t, False)["freed"])
    whole_rows = []
    for r, t in wholes:
        gc.collect()
        before = meter.live_bytes
        root, grad = stage.forward(r, 0, t)
        whole_rows.append((r, t, float(meter.live_bytes - before)))
        del root, grad
    return cell_rows, hold_rows, whole_rows, kv_per_token


def measure_memory(model: ModelDims, seq_length: int, vocab_size: Optional[int] = None,
                   granularity: int = 8, dtype: str = "bfloat16", device: Optional[str] = None,
                   position_embedding_type: str = "learned_absolute",
                   seed: int = 0) -> MemoryMeasurements:
    """Bytes each kind of stage keeps per cell (`memory_cells`), per deferred backward and per
    whole microbatch (1 and 2 rows of seq_length, seq_length / 2 and / 4 tokens), with the
    vocabulary `vocab_size` (default model.vocab_size; required)."""
    from ...runtime.memory.buffer_bytes import RuntimeMemoryMeter

    V = vocab_size if vocab_size is not None else model.vocab_size
    if V is None or int(V) <= 0:
        raise ValueError("measuring memory needs the vocabulary size (--vocab-size): the last "
                         "stage's logits are its largest activation")
    check_position_type(position_embedding_type)
    env = MeasureDevice(dtype, device, seed)
    cells = memory_cells(seq_length, granularity)
    wholes = [(r, t) for r in (1, 2) for t in (seq_length, seq_length // 2, seq_length // 4) if t > 0]
    out, freed = MemoryMeasurements({}, {}, {}, 0.0), {"plain": [], "deferred": []}
    for kind in STAGE_KINDS:
        stage = _Stage(env, model, kind, int(V), seq_length, position_embedding_type)
        with RuntimeMemoryMeter(exclude=stage.params) as meter, meter.counting_runtime_buffers():
            out.cells[kind], out.holds[kind], out.wholes[kind], kv = _measure_kind(
                stage, cells, meter, wholes, freed)
        out.kv_bytes_per_token = kv
    out.freed_before_kv_grad = min(freed["plain"])
    out.freed_before_kv_grad_deferred = min(freed["deferred"])
    measured = replace(model, vocab_size=int(V))
    out.metadata = {"model": measured.to_dict(), "position_embedding_type": position_embedding_type,
                    "seq_length": seq_length, **env.metadata(1, 0, "exact")}
    return out
