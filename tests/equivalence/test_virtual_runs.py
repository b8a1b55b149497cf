"""TeraPipe plans on virtual stages (V model chunks per rank) run as Megatron runs its
interleaved schedule's chunks, and train exactly: every parameter gradient and every reported
loss equal to Megatron's no-pipelining run on the full model (K * V chunks of layers), at the
equivalence suite's fp32 tolerances (harness.compare.FP32), and one case equal to Megatron's own
interleaved 1F1B (forward_backward_pipelining_with_interleaving) on the same chunks.

Each world (2 or 4 gloo processes) runs its cases once (module fixture); harness.runs.virtual_runs
builds the chunks with GPTModel(..., vp_stage=c) and harness.check_case compares, as for one
chunk per rank (test_equivalence.py). Also: what the schedule call refuses about chunks.

The cases named "in_a_v" put the two chunks of a rank in a V (virtual_placement "v", Zero
Bubble's ZB-V placement: rank k holds virtual stages k and 2K - 1 - k, the embedding and the
loss on rank 0), built as megatron_terapipe.v_chunk_roles and place_in_v say: the same
comparisons, every receive of the torch transport counted (the turn on the last rank is no
message), the losses reported on rank 0.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness import TinyGPT, check_case
from harness.runs.virtual_runs import VirtualCase
from megatron_terapipe import TeraPipePlan
from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset
from megatron_terapipe.planner.wgrad_slots import plan_wgrad


def plan(slices=(5, 7, 4), V=2, order="1f1b", defer=True, **kwargs) -> TeraPipePlan:
    return TeraPipePlan(list(slices), order=order, virtual_stages=V, defer_wgrad=defer, **kwargs)


def v_plan(slices=(5, 7, 4), order="1f1b", defer=True, **kwargs) -> TeraPipePlan:
    """Two chunks in a V (rank k: virtual stages k and 2K - 1 - k; the loss on rank 0)."""
    return plan(slices, 2, order, defer, virtual_placement="v", **kwargs)


def planned_places(tiny: TeraPipePlan, M: int, K: int, rows: int) -> TeraPipePlan:
    """`tiny` with the W places the planner gives a plan of the same cells (same slice count,
    order, chunks, microbatches) on a GPT3-1B cost model: places depend on the cells only."""
    cost = AnalyticCostModel(model_preset("gpt3-1b"), hardware_preset("a100"),
                             layers_per_stage=6, tensor_parallel=2)
    big = TeraPipePlan.uniform(512 * len(tiny.seq_slices), len(tiny.seq_slices),
                               order=tiny.order, multiple_of=64)
    placed, _ = plan_wgrad(replace(big, virtual_stages=tiny.virtual_stages,
                                   virtual_placement=tiny.virtual_placement,
                                   virtual_warmup=tiny.virtual_warmup), cost, M, K, rows)
    assert placed.wgrad_after, "the planner kept the default places: pick another shape"
    return replace(tiny, wgrad_after=placed.wgrad_after)


FOUR_LAYERS, EIGHT_LAYERS = TinyGPT(num_layers=4), TinyGPT(num_layers=8)

CASES_2 = [
    VirtualCase("v2_1f1b", plan(defer=False)),
    VirtualCase("v2_gpipe", plan(order="gpipe", defer=False)),
    VirtualCase("w_v2_1f1b", plan()),
    VirtualCase("w_v2_gpipe", plan(order="gpipe"), num_microbatches=2),
    VirtualCase("w_v2_planned_w_places", planned_places(plan(), 3, 2, 2)),
    VirtualCase("w_v2_gpipe_planned_w_places", planned_places(plan(order="gpipe"), 3, 2, 2)),
    VirtualCase("w_v2_one_microbatch_one_slice", plan([16]), num_microbatches=1),
    VirtualCase("w_v2_groups_of_3_of_5", plan(virtual_group=3), num_microbatches=5),
    VirtualCase("w_v2_batch_slices", TeraPipePlan([[8, 8], [4, 4, 8]], batch_slices=[1, 2],
                                                 virtual_stages=2), micro_batch_size=3),
    VirtualCase("w_v3_six_layers", plan(V=3), model=TinyGPT(num_layers=6), num_microbatches=2),
    VirtualCase("w_v2_tied_embeddings_ddp_overlap_grad_sync", planned_places(plan(), 3, 2, 2),
                model=TinyGPT(num_layers=4, untie=False), ddp=True, overlap_grad_reduce=True,
                grad_sync_func=True),
    VirtualCase("w_v2_deallocate_outputs", plan(), deallocate_outputs=True),
    # Megatron's communicator: sends do not wait; on 2 ranks one channel, in one order
    VirtualCase("w_v2_megatron_p2p", plan([8, 8]), transport="megatron", num_microbatches=4),
    # Megatron's interleaved 1F1B on the same chunks (its groups: K microbatches)
    VirtualCase("w_v2_against_megatron_interleaved", plan(), num_microbatches=4,
                reference="interleaved"),
    # Megatron-LM's packed sequences: block-diagonal causal masks, positions reset per document
    VirtualCase("w_v2_packed_documents", plan(), packed=True, num_microbatches=4),
    VirtualCase("w_v2_packed_documents_against_megatron_interleaved", plan(), packed=True,
                num_microbatches=4, reference="interleaved"),
    # chunks in a V (megatron_terapipe.v_chunk_roles, place_in_v): no message at the turn
    VirtualCase("in_a_v_whole_sequences", v_plan([16], defer=False), num_microbatches=4),
    VirtualCase("in_a_v_slices", v_plan(defer=False)),
    VirtualCase("w_in_a_v_slices", v_plan()),
    VirtualCase("w_in_a_v_gpipe", v_plan(order="gpipe"), num_microbatches=2),
    VirtualCase("w_in_a_v_lead_1_planned_w_places",
                planned_places(v_plan([8, 8], virtual_warmup=1), 4, 2, 1), num_microbatches=4),
    VirtualCase("w_in_a_v_one_microbatch", v_plan([6, 10]), num_microbatches=1),
    VirtualCase("w_in_a_v_deallocate_outputs", v_plan(), deallocate_outputs=True),
    VirtualCase("w_in_a_v_ddp_overlap_grad_sync", v_plan(), ddp=True, overlap_grad_reduce=True,
                grad_sync_func=True),
]

CASES_4 = [
    VirtualCase("v2_pp4_1f1b", plan(defer=False), pp=4, model=EIGHT_LAYERS, num_microbatches=5),
    VirtualCase("v2_pp4_gpipe", plan(order="gpipe", defer=False), pp=4, model=EIGHT_LAYERS),
    VirtualCase("w_v2_pp4_1f1b", plan(), pp=4, model=EIGHT_LAYERS, num_microbatches=5),
    VirtualCase("w_v2_pp4_gpipe", plan(order="gpipe"), pp=4, model=EIGHT_LAYERS),
    VirtualCase("w_v2_pp4_planned_w_places", planned_places(plan(), 4, 4, 2), pp=4,
                model=EIGHT_LAYERS, num_microbatches=4),
    VirtualCase("w_v2_pp4_megatron_p2p", plan([8, 8]), pp=4, model=EIGHT_LAYERS,
                num_microbatches=4, transport="megatron"),
    VirtualCase("w_v2_tp2_pp2", plan([6, 6, 4]), tp=2, model=FOUR_LAYERS),
    VirtualCase("w_v2_tp2_pp2_sequence_parallel_ddp", plan([6, 6, 4]), tp=2, ddp=True,
                model=TinyGPT(num_layers=4, sequence_parallel=True)),
    # whole sequences in groups of 3 of 5 microbatches (the planner's 32-microbatch plan
    # under sequence parallelism: 1 slice, groups of 11)
    VirtualCase("w_v2_tp2_pp2_sequence_parallel_one_slice_groups_of_3", plan([16], virtual_group=3),
                tp=2, ddp=True, num_microbatches=5,
                model=TinyGPT(num_layers=4, sequence_parallel=True)),
    # scatter-gather messages, whole sequences in groups of 3 with no second warm-up term (the
    # planner's 32-microbatch plan with --terapipe-scatter-gather-p2p: groups of 8, warm-up 0)
    VirtualCase("w_v2_tp2_pp2_scatter_gather_one_slice_groups_of_3_warmup_0",
                plan([16], virtual_group=3, virtual_warmup=0), tp=2, ddp=True, num_microbatches=5,
                model=FOUR_LAYERS, scatter_gather=True),
    VirtualCase("w_v2_tp2_pp2_scatter_gather_megatron_p2p", plan([8, 8]), tp=2,
                num_microbatches=4, model=FOUR_LAYERS, transport="megatron", scatter_gather=True),
    VirtualCase("v2_tp2_pp2_sequence_parallel_ddp_gpipe", plan([6, 6, 4], order="gpipe",
                defer=False), tp=2, ddp=True, model=TinyGPT(num_layers=4, sequence_parallel=True)),
    VirtualCase("v2_tp2_pp2_gpipe", plan([6, 6, 4], order="gpipe", defer=False), tp=2,
                model=FOUR_LAYERS),
    VirtualCase("w_v2_dp2_pp2_ddp_overlap", plan(), ddp=True, overlap_grad_reduce=True,
                num_microbatches=2),
    VirtualCase("v2_dp2_pp2_ddp_gpipe", plan(order="gpipe", defer=False), ddp=True),
    VirtualCase("in_a_v_pp4_slices", v_plan(defer=False), pp=4, model=EIGHT_LAYERS,
                num_microbatches=5),
    VirtualCase("w_in_a_v_pp4_planned_w_places", planned_places(v_plan([8, 8]), 4, 4, 1), pp=4,
                model=EIGHT_LAYERS, num_microbatches=4),
    VirtualCase("w_in_a_v_tp2_pp2", v_plan([6, 6, 4]), tp=2, model=FOUR_LAYERS),
    VirtualCase("w_in_a_v_dp2_pp2_ddp", v_plan(), ddp=True),
]


#: What the world2 / world4 fixtures run (conftest.py): WORKER on each world's cases.
WORKER = "harness.runs.virtual_runs:run_virtual_cases"
WORLDS = {2: CASES_2, 4: CASES_4}


@pytest.mark.parametrize("case", CASES_2, ids=[c.name for c in CASES_2])
def test_two_processes(world2, case):
    check_case(world2, case)


@pytest.mark.parametrize("case", CASES_4, ids=[c.name for c in CASES_4])
def test_four_processes(world4, case):
    check_case(world4, case)


def test_a_v_reports_its_losses_on_rank_0(world2):
    assert [r["in_a_v_slices"]["last_stage"] for r in world2] == [True, False]
    assert len(world2[0]["in_a_v_slices"]["losses"]) == 3


def test_scatter_gather_carries_half_of_each_message(world4):
    """On the ring of virtual stages each of the 2 TP ranks takes half of every message over
    the pipeline link: whole sequences of 16 tokens x 2 x hidden 32, half of that per message,
    through the torch transport (which counts its receives) and Megatron's communicator."""
    half = 16 * 2 * FOUR_LAYERS.hidden_size // 2
    for rank_result in world4:
        torch_sends = rank_result["w_v2_tp2_pp2_scatter_gather_one_slice_groups_of_3_warmup_0"]
        assert torch_sends["received_elements"] == torch_sends["receives"] * half > 0
        megatron = rank_result["w_v2_tp2_pp2_scatter_gather_megatron_p2p"]
        # two slices of 8 tokens, 4 microbatches, an input and a gradient per cell and chunk
        # but the ring's ends: 3 of the 4 (chunk, direction) streams on every rank
        assert megatron["received_elements"] == 4 * 2 * 3 * half // 2, megatron
