"""How many transformer layers each pipeline stage's model chunks hold, as Megatron builds them.

Megatron-LM splits the layers evenly unless the flags say otherwise: --decoder-first-pipeline-
num-layers / --decoder-last-pipeline-num-layers (uneven first and last stages),
--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split (the embedding
and the loss count as a layer of the first and last stage), or --pipeline-model-parallel-layout
(any split); a V (--terapipe-virtual-placement v) on a stage of odd layers builds its 2 chunks
unequal (plan.v_chunk_layers). The arithmetic is Megatron-Core's `get_num_layers_to_build`
(transformer_block.py), written out here because the plan is made from the flags, before the
model and its parallel state exist; tests/glue/test_stage_layers.py holds it equal to Megatron's
function. A layout string is read with Megatron-Core's own parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...plan import v_chunk_layers


@dataclass(frozen=True)
class StageLayers:
    """Transformer layers per model chunk of each pipeline stage: chunks[stage][chunk]."""

    chunks: tuple[tuple[int, ...], ...]
    source: str = ""  # the flag that made the split uneven, "" for Megatron's even split

    @property
    def per_stage(self) -> tuple[int, ...]:
        return tuple(sum(stage) for stage in self.chunks)

    @property
    def busiest(self) -> int:
        """The layers of the stage with the most: what the planner prices every stage as."""
        return max(self.per_stage)

    @property
    def even(self) -> bool:
        """Every chunk of every stage holds the same layers."""
        return len({n for stage in self.chunks for n in stage}) == 1

    @property
    def v_chunk_layers(self) -> tuple[int, ...]:
        """In a V (every stage's 2 chunks alike): the chunks' layers where they differ (an odd
        stage), else () (plan.v_chunk_layers)."""
        first = self.chunks[0]
        return tuple(first) if len(set(first)) > 1 else ()

    def describe(self) -> str:
        stages = " ".join("+".join(map(str, stage)) for stage in self.chunks)
        return f"layers per stage {stages} ({self.source})" if self.source else ""


def stage_layers(args) -> Optional[StageLayers]:
    """The split of Megatron-LM's `args` (after its validate_args), or None when the flags give
    no --num-layers. Raises ValueError where Megatron's own build would fail on the split."""
    layers = getattr(args, "num_layers", None)
    if layers is None:
        return None
    pp = int(getattr(args, "pipeline_model_parallel_size", None) or 1)
    vp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return _from_layout(layout, pp)
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    embedding = bool(getattr(args, "account_for_embedding_in_pipeline_split", False))
    loss = bool(getattr(args, "account_for_loss_in_pipeline_split", False))
    in_v = getattr(args, "terapipe_virtual_placement", None) == "v"
    chunks = tuple(tuple(chunk_layers(int(layers), pp, vp, stage, chunk, first=first, last=last,
                                      embedding=embedding, loss=loss, in_v=in_v)
                         for chunk in range(vp))
                   for stage in range(pp))
    flags = [name for name, on in (
        (f"--decoder-first-pipeline-num-layers {first}", first is not None),
        (f"--decoder-last-pipeline-num-layers {last}", last is not None),
        ("--account-for-embedding-in-pipeline-split", embedding),
        ("--account-for-loss-in-pipeline-split", loss)) if on]
    return StageLayers(chunks, ", ".join(flags))


def chunk_layers(num_layers: int, pp: int, vp: int, stage: int, chunk: int, *,
                 first: Optional[int] = None, last: Optional[int] = None,
                 embedding: bool = False, loss: bool = False, in_v: bool = False) -> int:
    """Megatron-Core's get_num_layers_to_build for pipeline rank `stage`, model chunk `chunk`
    (without a layout); `in_v`: 2 chunks in a V, which split an odd stage unequally
    (plan.v_chunk_layers, as model/v_layout.py builds them)."""
    if first is not None or last is not None:
        if embedding or loss:
            raise ValueError("Megatron does not build an uneven first or last stage together "
                             "with the embedding or the loss counted as a layer")
        rest, stages_left = num_layers, pp
        for given in (first, last):
            if given is not None:
                rest, stages_left = rest - given, stages_left - 1
        if stages_left > 0 and rest % stages_left:
            raise ValueError(f"{rest} layers do not divide over the {stages_left} middle stages")
        per_stage = rest // stages_left if stages_left > 0 else 0
        if stage == 0 and first is not None:
            per_stage = first
        if stage == pp - 1 and last is not None:
            per_stage = last
    else:
        total = num_layers + int(embedding) + int(loss)
        if total % pp:
            raise ValueError(f"{total} layers do not divide over {pp} pipeline stages")
        per_stage = total // pp
    count = per_stage
    if in_v and vp == 2 and pp > 1 and per_stage % 2:
        count = v_chunk_layers(per_stage)[chunk]
    elif vp > 1 and pp > 1:
        if per_stage % vp:
            raise ValueError(f"a stage's {per_stage} layers do not divide into {vp} model chunks")
        count = per_stage // vp
    if embedding and stage == 0 and chunk == 0:
        count -= 1
    if loss and stage == pp - 1 and chunk == vp - 1:
        count -= 1
    return count


def _from_layout(layout, pp: int) -> StageLayers:
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout)

    parsed = layout if isinstance(layout, PipelineParallelLayerLayout) else \
        PipelineParallelLayerLayout(layout, pp)
    chunks = tuple(tuple(chunk.count(LayerType.decoder) for chunk in stage)
                   for stage in parsed.layout)
    return StageLayers(chunks, f"--pipeline-model-parallel-layout {parsed}")
