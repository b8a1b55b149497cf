"""What a cell's CUDA graphs would capture of a Megatron GPT model: its transformer layers.

Megatron's own per-layer graphs (`--cuda-graph-impl local`) capture the transformer layers and
run the embedding, the output layer's loss and everything around them eagerly; the same holds
for TeraPipe cells. Two of those parts cannot be captured as they are: with TP > 1 the
vocab-parallel embedding writes `masked_input[input_mask] = 0`, and the vocab-parallel cross
entropy writes `masked_target[target_mask] = 0` (a tensor from a Python value, and on a GPU a
boolean-mask index that syncs). `eager_outside_layers` marks both as eager regions
(runtime/context.py), so the capture audit (runtime/graph_audit.py) checks what graphs would
capture.
"""

from __future__ import annotations

from typing import Callable

from ...runtime.context import eager_region


def _eager(fn: Callable) -> Callable:
    def run(*args, **kwargs):
        with eager_region():
            return fn(*args, **kwargs)
    return run


def eager_outside_layers(model) -> None:
    """Run `model`'s (a GPTModel stage's) embedding and language-model loss in eager regions."""
    model.compute_language_model_loss = _eager(model.compute_language_model_loss)
    if getattr(model, "embedding", None) is not None:
        model.embedding.forward = _eager(model.embedding.forward)
