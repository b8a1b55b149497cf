"""Runs TeraPipe cannot do stop with a ValueError naming the problem, before communicating."""

import time
from types import SimpleNamespace

import pytest

from megatron_terapipe import TeraPipePlan, configure
from megatron_terapipe.testing import Case, WorkerError, spawn


def _config(**kw):
    base = dict(context_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                num_moe_experts=None, sequence_parallel=False, tensor_model_parallel_size=1)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("kw, message", [
    (dict(context_parallel_size=2), "context parallelism"),
    (dict(virtual_pipeline_model_parallel_size=2), "virtual pipeline"),
    (dict(num_moe_experts=8), "MoE"),
    (dict(sequence_parallel=True, tensor_model_parallel_size=4), "multiples of the tensor-parallel size 4"),
])
def test_configure_rejects_unsupported_models(kw, message):
    with pytest.raises(ValueError, match=message):
        configure(_config(**kw), TeraPipePlan([6, 10]))


def test_configure_rejects_non_plans():
    with pytest.raises(ValueError, match="TeraPipePlan"):
        configure(_config(), [8, 8])


@pytest.mark.parametrize("case, message", [
    (Case("bad_sum", TeraPipePlan([8, 4])), "sum to 12 tokens but seq_length is 16"),
    (Case("bad_rows", TeraPipePlan([8, 8], batch_slices=[1, 2])), "sum to 3 rows but micro_batch_size is 2"),
    (Case("stock_spec", TeraPipePlan([8, 8]), slice_spec=False), "without the slice-aware attention"),
])
def test_bad_runs_fail_fast_on_every_rank(case, message):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=message):
        spawn(2, "megatron_terapipe.testing:run_cases", [case], timeout=120)
    assert time.monotonic() - start < 60
