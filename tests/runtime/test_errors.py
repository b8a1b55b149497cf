"""Runs TeraPipe cannot do stop with a ValueError naming the problem, on the rank that finds it."""

import re
from types import SimpleNamespace

import pytest

from megatron_terapipe import TeraPipePlan, configure
from harness import Case, WorkerError, spawn


def _config(**kw):
    base = dict(context_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                num_moe_experts=None, sequence_parallel=False, tensor_model_parallel_size=1)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("kw, message", [
    (dict(context_parallel_size=2), "context parallelism"),
    # virtual stages: the plan must run as many model chunks as the model has
    (dict(virtual_pipeline_model_parallel_size=2), r"1 model chunks per stage \(TeraPipePlan"),
    (dict(num_moe_experts=8, moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
    (dict(num_moe_experts=8, moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
    (dict(sequence_parallel=True, tensor_model_parallel_size=4), "multiples of the tensor-parallel size 4"),
])
def test_configure_rejects_unsupported_models(kw, message):
    with pytest.raises(ValueError, match=message):
        configure(_config(**kw), TeraPipePlan([6, 10]))


def test_configure_takes_a_plan_with_the_models_chunks():
    configure(_config(virtual_pipeline_model_parallel_size=2),
              TeraPipePlan([6, 10], virtual_stages=2))


def test_configure_rejects_non_plans():
    with pytest.raises(ValueError, match="TeraPipePlan"):
        configure(_config(), [8, 8])


BOTH = object()  # the same message on both ranks

# Per case, the message each rank must report (a regex); None: the rank only has to fail,
# because its peer stopped first.
BAD_RUNS = [
    (Case("bad_sum", TeraPipePlan([8, 4])), "sum to 12 tokens but seq_length is 16", BOTH),
    (Case("bad_rows", TeraPipePlan([8, 8], batch_slices=[1, 2])),
     "sum to 3 rows but micro_batch_size is 2", BOTH),
    (Case("stock_spec", TeraPipePlan([8, 8]), slice_spec=False),
     "without the slice-aware attention", BOTH),
    # each rank names the first non-causal layer of its own stage
    (Case("non_causal_spec", TeraPipePlan([8, 8]), attn_mask_type="no_mask"),
     "needs causal self-attention, but layer 1 uses attn_mask_type=no_mask",
     "needs causal self-attention, but layer 3 uses attn_mask_type=no_mask"),
    # only stage 0 sees its own output; stage 1 fails when stage 0's process is gone
    (Case("output_shape", TeraPipePlan([8, 8]), bad_output=True),
     r"returned \(7, 2, 32\) for cell m0b0t0 on stage 0, but the plan predicts \[tokens, rows, "
     r"hidden\] = \[8, 2, 32\]", None),
]


@pytest.mark.parametrize("case, rank0, rank1", [pytest.param(*run, id=run[0].name) for run in BAD_RUNS])
def test_bad_runs_fail_with_their_message(case, rank0, rank1):
    # A rank that hung instead would end in spawn's TimeoutError, not this WorkerError.
    with pytest.raises(WorkerError) as raised:
        spawn(2, "harness:run_cases", [case], timeout=120)
    reports = raised.value.reports
    assert sorted(reports) == [0, 1] and not raised.value.killed, raised.value
    for rank, message in enumerate([rank0, rank0 if rank1 is BOTH else rank1]):
        if message is not None:
            assert re.search(message, reports[rank]), f"rank {rank}:\n{reports[rank]}"


def test_packed_sequences_are_refused():
    import torch

    from megatron_terapipe.runtime.batching import check_lengths

    batch = {"tokens": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 3, 8])}
    with pytest.raises(ValueError, match="packed \\(THD\\) sequences"):
        check_lengths(batch, 8, 1)
    with pytest.raises(ValueError, match="4 rows but the schedule was called with micro_batch_size=2"):
        check_lengths({"tokens": torch.zeros(4, 8)}, 8, 2)

