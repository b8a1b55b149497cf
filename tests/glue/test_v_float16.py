"""Megatron's Float16Module in a V (megatron/model/v_layout.py): under --bf16 / --fp16 it casts
a chunk's inputs to half precision on the V's first chunk (rank 0, chunk 0) and its outputs
back to fp32 on the V's last chunk (rank 0, chunk 1, the loss), not where the ring's first and
last chunks sit. The matrix (test_megatron_lm_v.py) trains bf16 and fp16 V runs against 1f1b
at relative 1e-3, which the receiving stage's cast to the pipeline dtype would also meet; this
checks the casts themselves, chunk by chunk."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_terapipe.megatron.model import v_layout  # noqa: E402


class Chunk(torch.nn.Module):
    """A model chunk: its vp_stage, and what dtype its input arrived in."""

    def __init__(self, vp_stage: int):
        super().__init__()
        self.vp_stage, self.weight = vp_stage, torch.nn.Parameter(torch.ones(4))
        self.input_dtype = None

    def forward(self, x):
        self.input_dtype = x.dtype
        return x * self.weight


def _wrapped(vp_stage: int) -> Float16Module:
    config = TransformerConfig(num_layers=2, hidden_size=4, num_attention_heads=1, bf16=True,
                               params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                               pipeline_model_parallel_size=2,
                               virtual_pipeline_model_parallel_size=2)
    return Float16Module(config, Chunk(vp_stage))


@pytest.fixture
def in_a_v(monkeypatch):
    v_layout.use_v_layout(True)
    yield lambda rank, size: monkeypatch.setattr(v_layout, "_pipeline_rank_and_size",
                                                 lambda: (rank, size))
    v_layout.use_v_layout(False)


# (pipeline rank, chunk) on 2 ranks -> (inputs cast to bf16, outputs cast to fp32)
CASES = {(0, 0): (True, False), (0, 1): (False, True), (1, 0): (False, False),
         (1, 1): (False, False)}


@pytest.mark.parametrize("rank, chunk", list(CASES), ids=[f"rank{r}-chunk{c}" for r, c in CASES])
def test_float16_module_casts_where_the_v_places_the_first_and_last_chunk(in_a_v, rank, chunk):
    in_a_v(rank, 2)
    module = _wrapped(chunk)
    casts_input, casts_output = CASES[rank, chunk]
    x = torch.ones(4, dtype=torch.float32 if casts_input else torch.bfloat16)
    out = module(x)
    assert module.module.input_dtype == torch.bfloat16
    assert out.dtype == (torch.float32 if casts_output else torch.bfloat16)
