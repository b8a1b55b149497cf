"""Model chunks in a V (TeraPipePlan.virtual_placement "v", as Zero Bubble's ZB-V places them):
rank k of K holds virtual stages k (chunk 0) and 2K - 1 - k (chunk 1), so rank 0 runs both the
embedding and the loss, and the last rank hands chunk 0's output to its own chunk 1.

Megatron builds chunk c of rank k as virtual stage c * K + k of its ring: GPTModel(...,
vp_stage=c) numbers its layers from there, and parallel_state's is_pipeline_first_stage /
is_pipeline_last_stage give the ring's pre_process / post_process. For a V, build each chunk
with `v_chunk_roles`'s pre_process and post_process, then `place_in_v` renumbers chunk 1's
layers (layer_number, which names, loads and saves a layer's weights) from the ring's K + k to
the V's 2K - 1 - k. Only numbers change: a layer computes the same whatever its number (the
slice attention does not scale by it), and the weights are loaded after (by global number).
`check_v_chunks` refuses, before any work, chunks built otherwise and what a V cannot run yet.

Megatron's distributed checkpointing numbers layers from parallel_state (the ring), not from
layer_number: save and load a V's chunks by their layers' names (as the tests do), not with
Megatron's dist_checkpointing.
"""

from __future__ import annotations

from typing import Sequence

import torch


def v_chunk_roles(chunk: int, rank: int, num_stages: int) -> tuple[bool, bool]:
    """(pre_process, post_process) of model chunk `chunk` (0 or 1) on pipeline rank `rank` of
    `num_stages` in a V: the embedding on rank 0's chunk 0, the output layer and loss on rank
    0's chunk 1."""
    if chunk not in (0, 1) or not 0 <= rank < num_stages:
        raise ValueError(f"a V holds chunks 0 and 1 on ranks 0..{num_stages - 1}, got chunk "
                         f"{chunk} on rank {rank}")
    return rank == 0 and chunk == 0, rank == 0 and chunk == 1


def v_first_layer(chunk: int, rank: int, num_stages: int, layers_per_chunk: int,
                  chunk_layers: Sequence[int] = ()) -> int:
    """The layer_number (from 1) of the first layer of `chunk` on `rank` in a V: chunks of
    `layers_per_chunk` layers, or of chunk_layers (down, back) where they differ."""
    virtual_stage = rank if chunk == 0 else 2 * num_stages - 1 - rank
    down, back = chunk_layers or (layers_per_chunk, layers_per_chunk)
    return min(virtual_stage, num_stages) * down + max(0, virtual_stage - num_stages) * back + 1


def place_in_v(model: torch.nn.Module, chunk: int, rank: int, num_stages: int,
               chunk_layers: Sequence[int] = ()) -> None:
    """Renumber the layers of a chunk Megatron built as its ring's chunk `chunk` of `rank`
    (GPTModel(..., vp_stage=chunk)) to the V's: every module's layer_number in each layer
    (the layer's, its attention's, its router's) moves by the same amount. chunk_layers:
    the 2 chunks' layers (down, back) where they differ (plan.v_chunk_layers)."""
    layers = _layers(model)
    if not layers:
        return
    first = v_first_layer(chunk, rank, num_stages, len(layers), chunk_layers)
    shift = first - layers[0].layer_number
    for layer in layers:
        for module in layer.modules():
            if isinstance(getattr(module, "layer_number", None), int):
                module.layer_number += shift


def check_v_chunks(config, models: Sequence[torch.nn.Module], rank: int, num_stages: int,
                   planned: Sequence[int] = ()) -> None:
    """ValueError, before any work, unless the chunks are a V's (`v_chunk_roles`,
    `place_in_v`), hold the layers the plan was timed for (`planned`: its chunk_layers, empty
    for equal chunks), and the run is one a V runs: untied embeddings (Megatron all-reduces a
    tied output layer's gradient with the last rank's chunks)."""
    fix = ("build chunk c with pre_process, post_process = megatron_terapipe.v_chunk_roles(c, "
           "rank, pipeline size), then call megatron_terapipe.place_in_v(chunk, c, rank, "
           "pipeline size)")
    counts = tuple(len(_layers(_inner(model))) for model in models)
    chunk_layers = counts if len(set(counts)) > 1 else ()
    if all(counts) and chunk_layers != tuple(planned):
        raise ValueError(f"TeraPipe: the plan was made for a V's chunks of "
                         f"{list(planned) or 'equal'} layers, but rank {rank}'s chunks hold "
                         f"{list(counts)}: make the plan with chunk_layers={chunk_layers} "
                         "(() for equal chunks), or build the chunks as the plan says")
    for c, model in enumerate(models):
        inner = _inner(model)
        roles = (bool(getattr(inner, "pre_process", False)),
                 bool(getattr(inner, "post_process", False)))
        if roles != v_chunk_roles(c, rank, num_stages):
            raise ValueError(f"TeraPipe: a V (virtual_placement 'v') puts the embedding and the "
                             f"loss on rank 0, but chunk {c} on rank {rank} has (pre_process, "
                             f"post_process) = {roles}: {fix}")
        layers = _layers(inner)
        first = v_first_layer(c, rank, num_stages, len(layers), chunk_layers)
        if layers and layers[0].layer_number != first:
            raise ValueError(f"TeraPipe: chunk {c} on rank {rank} starts at layer "
                             f"{layers[0].layer_number}, not at the V's {first}: {fix}")
        if getattr(inner, "share_embeddings_and_output_weights", False):
            raise ValueError("TeraPipe: a V runs with untied embedding and output weights: build "
                             "GPTModel with share_embeddings_and_output_weights=False "
                             "(--untie-embeddings-and-output-weights)")


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under Megatron's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _layers(model: torch.nn.Module) -> list:
    decoder = getattr(_inner(model), "decoder", None)
    return list(getattr(decoder, "layers", []))
