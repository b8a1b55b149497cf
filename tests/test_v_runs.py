"""TeraPipe plans on model chunks in a V (TeraPipePlan.virtual_placement "v", Zero Bubble's ZB-V
placement: rank k holds virtual stages k and 2K - 1 - k, the embedding and the loss on rank 0)
run and train exactly: every parameter gradient and every reported loss equal to Megatron's
no-pipelining run on the full model, at the equivalence suite's fp32 tolerances
(harness.compare.FP32), with token slices, deferred and placed W actions, on 2 and 4 ranks,
with TP=2 and with DP=2 under Megatron DDP; harness.check_case also counts every receive of the
torch transport (the turn on the last rank is no message) and, with deallocated outputs, every
sent output freed.

Each rank builds its chunks as megatron_terapipe.v_chunk_roles and place_in_v say
(harness.virtual_runs.build_chunks) and loads the full model's weights by each layer's global
number. Also: what the schedule call refuses about a V's chunks, before any work.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness import TinyGPT, check_case, spawn
from harness.virtual_runs import VirtualCase
from megatron_terapipe import TeraPipePlan, place_in_v, v_chunk_roles
from megatron_terapipe.megatron.hooks.v_chunks import check_v_chunks
from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset
from megatron_terapipe.planner.wgrad_placement import plan_wgrad


def v_plan(slices=(5, 7, 4), order="1f1b", defer=True, **kwargs) -> TeraPipePlan:
    return TeraPipePlan(list(slices), order=order, virtual_stages=2, virtual_placement="v",
                        defer_wgrad=defer, **kwargs)


def planned_places(tiny: TeraPipePlan, M: int, K: int) -> TeraPipePlan:
    """`tiny` with the W places the planner gives a V plan of the same cells on a GPT3-1B cost
    model (places depend on the cells only)."""
    cost = AnalyticCostModel(model_preset("gpt3-1b"), hardware_preset("a100"),
                             layers_per_stage=6, tensor_parallel=2)
    big = replace(TeraPipePlan.uniform(512 * len(tiny.seq_slices), len(tiny.seq_slices),
                                       order=tiny.order, multiple_of=64),
                  virtual_stages=2, virtual_placement="v",
                  virtual_warmup=tiny.virtual_warmup)
    placed, _ = plan_wgrad(big, cost, M, K, 1)
    assert placed.wgrad_after, "the planner kept the default places: pick another shape"
    return replace(tiny, wgrad_after=placed.wgrad_after)


FOUR_LAYERS, EIGHT_LAYERS = TinyGPT(num_layers=4), TinyGPT(num_layers=8)

CASES_2 = [
    VirtualCase("v_whole_sequences", v_plan([16], defer=False), num_microbatches=4),
    VirtualCase("v_slices", v_plan(defer=False)),
    VirtualCase("v_slices_deferred_w", v_plan()),
    VirtualCase("v_gpipe_deferred_w", v_plan(order="gpipe"), num_microbatches=2),
    VirtualCase("v_warmup_1_w_placed", planned_places(v_plan([8, 8], virtual_warmup=1), 4, 2),
                num_microbatches=4),
    VirtualCase("v_one_microbatch", v_plan([6, 10]), num_microbatches=1),
    VirtualCase("v_deallocate_outputs", v_plan(), deallocate_outputs=True),
]

CASES_4 = [
    VirtualCase("v_pp4_slices", v_plan(defer=False), pp=4, model=EIGHT_LAYERS,
                num_microbatches=5),
    VirtualCase("v_pp4_deferred_w_placed", planned_places(v_plan([8, 8]), 4, 4), pp=4,
                model=EIGHT_LAYERS, num_microbatches=4),
    VirtualCase("v_tp2_pp2", v_plan([6, 6, 4]), tp=2, model=FOUR_LAYERS),
    VirtualCase("v_dp2_pp2_ddp", v_plan(), ddp=True, model=FOUR_LAYERS),
]


@pytest.fixture(scope="module")
def world2():
    return spawn(2, "harness.virtual_runs:run_virtual_cases", CASES_2, timeout=900)


@pytest.fixture(scope="module")
def world4():
    return spawn(4, "harness.virtual_runs:run_virtual_cases", CASES_4, timeout=900)


@pytest.mark.parametrize("case", CASES_2, ids=[c.name for c in CASES_2])
def test_two_processes(world2, case):
    check_case(world2, case)


@pytest.mark.parametrize("case", CASES_4, ids=[c.name for c in CASES_4])
def test_four_processes(world4, case):
    check_case(world4, case)


def test_the_loss_is_on_rank_0(world2):
    assert [r["v_slices"]["last_stage"] for r in world2] == [True, False]
    assert len(world2[0]["v_slices"]["losses"]) == 3


class Layer(torch.nn.Module):
    def __init__(self, number: int) -> None:
        super().__init__()
        self.layer_number = number
        self.self_attention = torch.nn.Module()
        self.self_attention.layer_number = number


class Chunk(torch.nn.Module):
    """What check_v_chunks and place_in_v read of a GPTModel."""

    def __init__(self, pre: bool, post: bool, first_layer: int, layers: int = 2,
                 tied: bool = False) -> None:
        super().__init__()
        self.pre_process, self.post_process = pre, post
        self.share_embeddings_and_output_weights = tied
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(Layer(first_layer + i) for i in range(layers))


def test_v_roles_and_layer_numbers():
    assert [v_chunk_roles(c, k, 4) for k in (0, 3) for c in (0, 1)] == [
        (True, False), (False, True), (False, False), (False, False)]
    chunk = Chunk(False, False, first_layer=11)  # Megatron's ring: rank 1 of 4, chunk 1: 4 + 1
    place_in_v(chunk, 1, 1, 4)  # the V's: virtual stage 2 * 4 - 1 - 1 = 6, layers 13 and 14
    assert [(layer.layer_number, layer.self_attention.layer_number)
            for layer in chunk.decoder.layers] == [(13, 13), (14, 14)]
    with pytest.raises(ValueError, match="a V holds chunks 0 and 1 on ranks 0..1, got chunk 2"):
        v_chunk_roles(2, 0, 2)


class Config:
    calculate_per_token_loss = False
    num_moe_experts = None


@pytest.mark.parametrize("chunks,config,message", [
    # Megatron's ring: the loss on the last rank's chunk 1
    ([Chunk(False, False, 3), Chunk(False, True, 7)], Config(),
     r"chunk 1 on rank 1 has \(pre_process, post_process\) = \(False, True\): build chunk c "
     r"with pre_process, post_process = megatron_terapipe.v_chunk_roles"),
    ([Chunk(False, False, 3), Chunk(False, False, 7)], Config(),
     "chunk 1 on rank 1 starts at layer 7, not at the V's 5: .*place_in_v"),
    ([Chunk(False, False, 3), Chunk(False, False, 5, tied=True)], Config(),
     "untied embedding and output weights.*--untie-embeddings-and-output-weights"),
    ([Chunk(False, False, 3), Chunk(False, False, 5)],
     type("PerToken", (Config,), {"calculate_per_token_loss": True})(),
     "a V runs without calculate_per_token_loss"),
    ([Chunk(False, False, 3), Chunk(False, False, 5)],
     type("MoE", (Config,), {"num_moe_experts": 4})(), "a V runs dense models only"),
])
def test_chunks_not_built_for_a_v_are_refused(chunks, config, message):
    with pytest.raises(ValueError, match=message):
        check_v_chunks(config, chunks, rank=1, num_stages=2)
    if message.startswith("chunk 1 on rank 1 starts"):  # the same chunks, placed: accepted
        place_in_v(chunks[1], 1, 1, 2)
        check_v_chunks(config, chunks, rank=1, num_stages=2)
