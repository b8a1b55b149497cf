"""Measure the pipeline's edges for ProfiledCostModel: the first stage's LanguageModelEmbedding,
and the last stage's final layer norm, output layer (ColumnParallelLinear hidden -> vocab, as
GPTModel builds it) and loss (vocab_parallel_cross_entropy and a masked sum, as pretrain_gpt's
loss does), forward and backward, on a few (batch, length) points. Megatron-Core is imported
lazily."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ...planner.cost.dims import ModelDims
from ...planner.profile.time_samples import EdgeMeasurements
from .clocks import clock_metadata, make_clock, timed
from .device_setup import MeasureDevice, check_position_type, check_repeats, timed_rounds

CACHE_FLUSH_BYTES = 8 << 20  # touched before each timed edge part on CPU (evicts L1/L2)


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


def _default_points(seq_length: Optional[int], batch_sizes: Sequence[int],
                    granularity: int) -> list[tuple[int, int]]:
    """Every batch size at 4 lengths from `granularity` to `seq_length`, spaced geometrically."""
    if seq_length is None:
        raise ValueError("measure_edge_times needs `points` or `seq_length`")
    lengths = sorted({int(min(seq_length, max(granularity, granularity * round(x / granularity))))
                      for x in np.geomspace(granularity, max(granularity, seq_length), 4)})
    return [(int(b), l) for b in batch_sizes for l in lengths]


class _EdgeParts:
    """The embedding and the output layer + loss, built as GPTModel builds them; `run(b, l)`
    times each part's forward and backward on random tokens."""

    def __init__(self, env: MeasureDevice, model: ModelDims, vocab_size: int, max_seq: int,
                 position_embedding_type: str, seed: int, clock):
        from megatron.core import tensor_parallel
        from megatron.core.models.common.embeddings.language_model_embedding import (
            LanguageModelEmbedding)
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_block import LayerNormImpl

        config = env.config(model)
        self.env, self.vocab_size, self.hidden = env, vocab_size, model.hidden_size
        self.clock = clock
        self.embedding = LanguageModelEmbedding(
            config=config, vocab_size=vocab_size, max_sequence_length=max_seq,
            position_embedding_type=position_embedding_type)
        self.final_norm = build_module(LayerNormImpl, config=config, hidden_size=self.hidden,
                                       eps=config.layernorm_epsilon)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            self.hidden, vocab_size, config=config, init_method=config.init_method, bias=False,
            skip_bias_add=False, gather_output=False)
        self.cross_entropy = tensor_parallel.vocab_parallel_cross_entropy
        for module in (self.embedding, self.final_norm, self.output_layer):
            module.to(device=env.device, dtype=env.dtype).train()
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        # In a pipeline stage, transformer layers run between an edge part and the next one, so
        # the edge's weights are not in the CPU's caches. Evict them before each timed part, or
        # a part would run warm or cold depending on what was measured just before it.
        self.scratch = None if env.on_gpu else torch.zeros(CACHE_FLUSH_BYTES // 4)

    def run(self, b: int, l: int) -> tuple[float, float, float, float]:
        """Seconds of embedding forward, backward, output forward, backward."""
        return self.clock.retried(lambda: self._run(b, l))

    def _run(self, b: int, l: int) -> tuple[float, float, float, float]:
        dev, dt, gen, V, h = self.env.device, self.env.dtype, self.generator, self.vocab_size, self.hidden
        ids = torch.randint(0, V, (b, l), generator=gen).to(dev)
        positions = torch.arange(l).unsqueeze(0).expand(b, -1).contiguous().to(dev)
        grad = torch.randn(l, b, h, generator=gen).to(device=dev, dtype=dt)
        hidden = torch.randn(l, b, h, generator=gen).to(device=dev, dtype=dt).requires_grad_(True)
        labels = torch.randint(0, V, (b, l), generator=gen).to(dev)
        loss_mask = (torch.rand(b, l, generator=gen) > 0.25).float().to(dev)
        emb_forward, emb = self._timed(lambda: self.embedding(input_ids=ids, position_ids=positions))
        emb_backward, _ = self._timed(lambda: emb.backward(grad))  # emb: [l, b, h]
        out_forward, loss = self._timed(lambda: self._loss(hidden, labels, loss_mask))
        out_backward, _ = self._timed(loss.backward)
        return emb_forward, emb_backward, out_forward, out_backward

    def _loss(self, hidden, labels, loss_mask):
        logits, _ = self.output_layer(self.final_norm(hidden))  # [l, b, V / tp]
        # GPTModel.compute_language_model_loss: [b, l] labels in, [b, l] losses out
        losses = self.cross_entropy(logits, labels.transpose(0, 1).contiguous())
        losses = losses.transpose(0, 1).contiguous()
        return torch.sum(losses.float().view(-1) * loss_mask.view(-1))  # pretrain_gpt's loss_func

    def _timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.scratch is not None:
            self.scratch.add_(1.0)
        return timed(self.clock, fn)


def measure_edge_times(model: ModelDims, points: Optional[Sequence[tuple[int, int]]] = None,
                       vocab_size: Optional[int] = None,
                       position_embedding_type: str = "learned_absolute",
                       max_sequence_length: Optional[int] = None,
                       seq_length: Optional[int] = None, batch_sizes: Sequence[int] = (1,),
                       granularity: int = 8, dtype: str = "bfloat16", device: Optional[str] = None,
                       repeats: int = 3, warmup: int = 1, progress: bool = True, seed: int = 0,
                       statistic: str = "min", timing: str = "wall") -> EdgeMeasurements:
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
    the cells of an iteration. Other arguments (timing too) as for measure_layer_times.
    """
    V = vocab_size if vocab_size is not None else model.vocab_size
    if V is None or int(V) <= 0:
        raise ValueError("measuring the edges needs a positive vocab_size (argument or ModelDims)")
    V = int(V)
    check_position_type(position_embedding_type)
    if points is None:
        points = _default_points(seq_length, batch_sizes, granularity)
    points = [(int(b), int(l)) for b, l in points]
    if not points or any(b <= 0 or l <= 0 for b, l in points):
        raise ValueError(f"edge points must be positive (batch, length) pairs, got {points}")
    check_repeats(repeats, statistic, timing)
    max_seq = int(max_sequence_length or max(l for _, l in points))
    if max_seq < max(l for _, l in points):
        raise ValueError(f"max_sequence_length {max_seq} is shorter than the longest point")
    env = MeasureDevice(dtype, device, seed)
    if V % env.tp:
        raise ValueError(f"vocab_size {V} is not divisible by the tensor-parallel size {env.tp}: "
                         "give the padded vocabulary size")
    parts = _EdgeParts(env, model, V, max_seq, position_embedding_type, seed,
                       make_clock(timing, env.sync, env.on_gpu))
    parts.run(*max(points, key=lambda p: p[0] * p[1]))  # one-off costs, and the gradients exist
    # settle=1: on CPU the first run of a shape after a much larger one is up to 2x slower for
    # small shapes (seen at hidden 64: 190 vs 117 us), a transient a steady pipeline of
    # similar cells does not see; each timed run follows an untimed run of the same shape.
    stat = timed_rounds(points, parts.run, repeats, warmup, statistic, "measuring edges",
                        progress, settle=1)
    arr = np.array(points, dtype=np.float64)
    metadata = {"vocab_size": V, "position_embedding_type": position_embedding_type,
                "max_sequence_length": max_seq, "hidden_size": model.hidden_size,
                "output_includes": "final layer norm, output layer, cross entropy, masked sum",
                **env.metadata(repeats, warmup, statistic, timing), **clock_metadata(parts.clock)}
    return EdgeMeasurements(arr[:, 0], arr[:, 1], stat[:, 0], stat[:, 1], stat[:, 2], stat[:, 3],
                            metadata)
