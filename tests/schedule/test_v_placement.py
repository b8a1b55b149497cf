"""Model chunks in a V (TeraPipePlan.virtual_placement "v"; schedule/routes.py, v_order.py):
rank k holds virtual stages k and 2K - 1 - k. Its schedules validate (deadlock-free, every
message paired) on every small shape; messages go down the ranks on chunk 0 and back up on
chunk 1, with no message at the turn; it runs the same work as the ring with both edges on
rank 0; its order keeps at most K + cells - 1 + lead units in flight on rank 0; W placement is timed to
the bit on it; the runtime's refusals (a transport without the V's routes, CUDA graphs, unequal
chunks) before any work; the chunks a V runs on (`v_chunk_roles`, `place_in_v`) and those
refused before any work (`check_v_chunks`). The runs themselves: tests/equivalence/test_virtual_runs.py,
its "in_a_v" cases."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_terapipe import (ScheduleError, TeraPipePlan, build_schedule, place_in_v,
                               v_chunk_roles, validate)
from megatron_terapipe.megatron.model.v_chunks import check_v_chunks, v_first_layer
from megatron_terapipe.plan import v_chunk_layers
from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset, simulate
from megatron_terapipe.planner.evaluate.simulator import plan_time
from megatron_terapipe.planner.wgrad_slots import POLICIES, WgradPlacer, plan_wgrad
from megatron_terapipe.runtime.executor import StageExecutor
from megatron_terapipe.runtime.comm.transport import Transport
from megatron_terapipe.schedule.lower import lower

BIG = AnalyticCostModel(model_preset("gpt3-13b"), hardware_preset("h100"), layers_per_stage=5,
                        tensor_parallel=8, inter_node=True)


def v_plan(slices=(4,), order="1f1b", layers=(), lead=None, batch=None, defer=True):
    return TeraPipePlan(list(slices), batch_slices=batch, order=order, defer_wgrad=defer,
                        virtual_stages=2, virtual_placement="v", chunk_layers=layers,
                        virtual_warmup=lead)


plans = st.builds(
    lambda slices, batch, order, layers, lead, defer: v_plan(slices, order, layers, lead, batch, defer),
    st.lists(st.integers(1, 4), min_size=1, max_size=3), st.one_of(st.none(), st.just([1, 1])),
    st.sampled_from(["1f1b", "gpipe"]), st.sampled_from([(), (1, 2), (3, 1)]),
    st.sampled_from([None, 0, 2]), st.booleans())


@settings(max_examples=80, deadline=None)
@given(plan=plans, M=st.integers(1, 5), K=st.integers(2, 5))
def test_v_schedules_validate_on_small_shapes(plan, M, K):
    validate(build_schedule(plan, M, K, 2))  # raises ScheduleError on any broken rule


def test_messages_go_down_on_chunk_0_and_back_up_on_chunk_1():
    K = 4
    lowered = lower(build_schedule(v_plan(), 2, K, 1))
    sends = {(k, str(a.kind), a.cell.chunk) for k, actions in enumerate(lowered)
             for a in actions if str(a.kind) in ("SEND_F", "SEND_B", "RECV_F", "RECV_B")}
    expected = set()
    for k in range(K):
        if k < K - 1:  # down on chunk 0; the turn (rank K - 1) is no message
            expected |= {(k, "SEND_F", 0), (k + 1, "RECV_F", 0), (k + 1, "SEND_B", 0),
                         (k, "RECV_B", 0)}
            # back up on chunk 1, from rank k + 1 to rank k
            expected |= {(k + 1, "SEND_F", 1), (k, "RECV_F", 1), (k, "SEND_B", 1),
                         (k + 1, "RECV_B", 1)}
    assert sends == expected


def test_the_v_runs_the_ring_s_work_with_both_edges_on_rank_0():
    """The same layers and edges, placed differently: the stages' compute adds up to one
    chunk per stage's, and rank 0 carries the embedding and the output layer."""
    K, M = 4, 6
    plain = simulate(build_schedule(TeraPipePlan([8192]), M, K, 1), BIG)
    for layers in ((), (2, 3)):
        v = simulate(build_schedule(v_plan((8192,), layers=layers), M, K, 1), BIG)
        assert sum(v.busy) == pytest.approx(sum(plain.busy), rel=1e-9)
        assert v.busy[0] == pytest.approx(plain.busy[0] + plain.busy[-1] - plain.busy[1], rel=1e-9)
        assert v.busy[1:] == pytest.approx([plain.busy[1]] * (K - 1), rel=1e-9)


@pytest.mark.parametrize("lead", [None, 0, 1, 3])
@pytest.mark.parametrize("slices", [(8,), (4, 4), (2, 3, 3)])
def test_rank_0_keeps_at_most_k_plus_cells_minus_1_plus_lead_units_in_flight(lead, slices):
    K, M = 4, 8
    rank0 = build_schedule(v_plan(slices, lead=lead), M, K, 1).stages[0]
    in_flight = most = 0
    for a in rank0:
        if a.cell.chunk == 0 and str(a.kind) in ("F", "B"):
            in_flight += 1 if str(a.kind) == "F" else -1
            most = max(most, in_flight)
    # units enter as soon as the cap allows; a whole microbatch reaches the loss first
    assert most == K + len(slices) - 1 + (lead or 0)


def test_w_placement_on_a_v_is_timed_exactly():
    plan = v_plan((2048, 2048, 4096), layers=(2, 3))
    schedule = build_schedule(plan, 4, 4, 1)
    default = simulate(schedule, BIG)
    placer = WgradPlacer(schedule, BIG)
    for policy in POLICIES:
        places, time = placer.place(policy, None)
        placed = simulate(build_schedule(replace(plan, wgrad_after=places), 4, 4, 1), BIG)
        assert placed.iteration_time == time
    best, time = plan_wgrad(plan, BIG, 4, 4, 1, None)
    assert time <= default.iteration_time
    assert time == plan_time(best, BIG, 4, 4, 1)


def test_the_runtime_refuses_a_v_it_cannot_carry_before_any_work():
    # Megatron's communicator (as any transport without the V's routes) cannot send back up
    with pytest.raises(ValueError, match="virtual_placement 'v' sends chunk 1's messages back "
                                         "up the ranks, which Transport does not carry"):
        StageExecutor(build_schedule(v_plan(), 2, 2, 1), 0, None, None, Transport(), None, None)

    class Carrier(Transport):
        runs_v_shape = True

    with pytest.raises(ValueError, match="virtual_placement 'v' runs without CUDA graphs"):
        StageExecutor(build_schedule(v_plan(), 2, 2, 1), 0, None, None, Carrier(), None, None,
                      graphs=object())


def test_placement_fields_are_checked_and_kept():
    with pytest.raises(ValueError, match="virtual_placement 'v' holds 2 model chunks"):
        TeraPipePlan([4], virtual_stages=3, virtual_placement="v")
    with pytest.raises(ValueError, match="virtual_placement must be one of"):
        TeraPipePlan([4], virtual_stages=2, virtual_placement="w")
    with pytest.raises(ValueError, match="chunk_layers must give 2 positive layer counts"):
        TeraPipePlan([4], virtual_stages=2, chunk_layers=(5,))
    with pytest.raises(ValueError, match=r"chunk_layers \[2, 2\] hold 4 layers, a pipeline stage 5"):
        TeraPipePlan([4], virtual_stages=2, chunk_layers=(2, 2)).check_layers(5)
    plan = v_plan(layers=(2, 3), lead=1)
    assert TeraPipePlan.from_dict(plan.to_dict()) == plan
    assert "2 chunks per stage in a V of 2+3 layers" in plan.describe()
    assert "virtual_placement" not in TeraPipePlan([4]).to_dict()  # old files read as before


def test_validate_refuses_a_turn_taken_before_it_is_handed_over():
    """The last rank's chunk 1 takes chunk 0's output within the rank: its list must run
    chunk 0's forward first (and chunk 1's backward before chunk 0's)."""
    schedule = build_schedule(v_plan(), 1, 2, 1)
    last = list(schedule.stages[-1])
    f0 = next(i for i, a in enumerate(last) if str(a) == "F(m0b0t0c0)")
    f1 = next(i for i, a in enumerate(last) if str(a) == "F(m0b0t0c1)")
    last[f0], last[f1] = last[f1], last[f0]
    broken = replace(schedule, stages=schedule.stages[:-1] + (tuple(last),))
    with pytest.raises(ScheduleError, match=r"stage 1 runs F\(m0b0t0c1\) before F\(m0b0t0c0\), "
                                            "whose output it takes"):
        validate(broken)


def test_the_virtual_search_in_a_v_times_every_lead_and_places_w():
    from megatron_terapipe.planner import SearchSpace, search_virtual
    from megatron_terapipe.planner.cost.stage_memory import MemoryBudget
    from megatron_terapipe.planner.virtual_search import V_LEADS, virtual_plans

    space = SearchSpace(4096, 1, 4, 8, order="1f1b", granularity=256, defer_wgrad=True,
                        place_wgrad=True)
    candidates = virtual_plans(space, 2, placement="v")
    assert {p.virtual_warmup for _, p in candidates} == set(V_LEADS)
    assert all(p.virtual_placement == "v" and p.virtual_group is None for _, p in candidates)
    found = search_virtual(BIG, space, MemoryBudget(None), 2, placement="v")
    assert found.plan.virtual_placement == "v"
    # no candidate with its W actions in their default places is faster
    fastest = min(plan_time(p, BIG, 8, 4, 1) for _, p in candidates)
    assert found.plan.predicted_time <= fastest
    assert found.plan.predicted_time == plan_time(found.plan, BIG, 8, 4, 1)
    with pytest.raises(ValueError, match="a V holds 2 model chunks per rank, not 3"):
        search_virtual(BIG, space, MemoryBudget(None), 3, placement="v")


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
])
def test_chunks_not_built_for_a_v_are_refused(chunks, config, message):
    with pytest.raises(ValueError, match=message):
        check_v_chunks(config, chunks, rank=1, num_stages=2)
    if message.startswith("chunk 1 on rank 1 starts"):  # the same chunks, placed: accepted
        place_in_v(chunks[1], 1, 1, 2)
        check_v_chunks(config, chunks, rank=1, num_stages=2)


def test_unequal_chunks_in_a_v_are_numbered_down_and_back():
    """A V of 2 stages of 3 layers in chunks of 2 (down) and 1 (back): virtual stages 0..3
    start at layers 1, 3, 5 and 6; chunks built otherwise than the plan's are refused."""
    assert v_chunk_layers(3) == (2, 1) and v_chunk_layers(5) == (3, 2) and v_chunk_layers(4) == ()
    with pytest.raises(ValueError, match="need 2 or more layers per stage, got 1"):
        v_chunk_layers(1)
    firsts = {(k, c): v_first_layer(c, k, 2, 0, (2, 1)) for k in (0, 1) for c in (0, 1)}
    assert firsts == {(0, 0): 1, (1, 0): 3, (1, 1): 5, (0, 1): 6}
    chunks = [Chunk(False, False, 3, layers=2), Chunk(False, False, 5, layers=1)]  # the ring's
    place_in_v(chunks[1], 1, 1, 2, (2, 1))  # rank 1's chunk 1 is virtual stage 2: layer 5
    check_v_chunks(Config(), chunks, rank=1, num_stages=2, planned=(2, 1))
    with pytest.raises(ValueError, match=r"the plan was made for a V's chunks of equal layers, "
                                         r"but rank 1's chunks hold \[2, 1\]"):
        check_v_chunks(Config(), chunks, rank=1, num_stages=2)
    with pytest.raises(ValueError, match=r"chunks of \[1, 2\] layers, but rank 1's chunks hold"):
        check_v_chunks(Config(), chunks, rank=1, num_stages=2, planned=(1, 2))
