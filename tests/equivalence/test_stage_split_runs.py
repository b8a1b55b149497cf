"""Uneven splits of the layers over the stages, run: TeraPipe against Megatron's no-pipelining run.

Megatron-Core splits a model's layers unevenly when its config says so
(`num_layers_in_first_pipeline_stage`, `num_layers_in_last_pipeline_stage`,
`account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split`, or a
`pipeline_model_parallel_layout`); Megatron-LM's flags of the same names set them
(tests/glue/test_megatron_lm_configs.py runs its script with them). Here each split runs through
`forward_backward_terapipe` on 2 and 4 gloo processes, and `harness.check_case` compares every
parameter gradient and every reported loss with the full model's no-pipelining run at the
equivalence suite's fp32 tolerances (harness.compare.FP32: max-normalised 1e-5, rtol 1e-4 /
atol 1e-6; losses rtol / atol 1e-6). Each case also checks the layers each rank held, so that
a split Megatron did not apply cannot pass as an even one.
"""

from __future__ import annotations

import re

import pytest

from harness import Case, TinyGPT, check_case
from megatron_terapipe import TeraPipePlan


def split(layers: int = 4, **fields) -> TinyGPT:
    """TinyGPT with these TransformerConfig fields on its pipelined configs only."""
    return TinyGPT(num_layers=layers, stage_split=tuple(sorted(fields.items())))


#: (case, the layers each pipeline rank must hold)
CASES_2 = [
    (Case("first_stage_1_of_4", TeraPipePlan([5, 7, 4]), num_microbatches=4,
          model=split(num_layers_in_first_pipeline_stage=1)), [[0], [1, 2, 3]]),
    (Case("last_stage_1_of_4_gpipe_not_deferred",
          TeraPipePlan([8, 8], order="gpipe", defer_wgrad=False),
          model=split(num_layers_in_last_pipeline_stage=1)), [[0, 1, 2], [3]]),
    (Case("layout_Et_ttt_L", TeraPipePlan([6, 10]), micro_batch_size=1,
          model=split(pipeline_model_parallel_layout="Et|ttt,L")), [[0], [1, 2, 3]]),
]
CASES_4 = [
    # (6 layers + embedding + loss) / 4 stages: 1, 2, 2 and 1 layers
    (Case("pp4_embedding_and_loss_counted", TeraPipePlan([4, 4, 8]), pp=4, num_microbatches=5,
          model=split(6, account_for_embedding_in_pipeline_split=True,
                      account_for_loss_in_pipeline_split=True)),
     [[0], [1, 2], [3, 4], [5]]),
    (Case("tp2_pp2_first_stage_3_of_4_ddp", TeraPipePlan([6, 6, 4]), tp=2, ddp=True,
          model=split(num_layers_in_first_pipeline_stage=3)), [[0, 1, 2], [3]]),
]


#: What the world2 / world4 fixtures run (conftest.py): WORKER on each world's cases.
WORKER = "harness:run_cases"
WORLDS = {2: [case for case, _ in CASES_2], 4: [case for case, _ in CASES_4]}
WORLD_TIMEOUT = 600


def held_layers(rank_result: dict) -> list[int]:
    """The global layer numbers of the gradients a rank reported."""
    found = (re.search(r"layers\.(\d+)\.", name) for name in rank_result["grads"])
    return sorted({int(m.group(1)) for m in found if m})


def check_split(results: list, case: Case, layers: list[list[int]]) -> None:
    check_case(results, case)
    for rank, result in enumerate(results):
        stage = rank // (len(results) // case.pp)  # Megatron's rank order puts pp outermost
        assert held_layers(result[case.name]) == layers[stage], (case.name, rank)


@pytest.mark.parametrize("case, layers", CASES_2, ids=[c.name for c, _ in CASES_2])
def test_uneven_splits_two_processes(world2, case, layers):
    check_split(world2, case, layers)


@pytest.mark.parametrize("case, layers", CASES_4, ids=[c.name for c, _ in CASES_4])
def test_uneven_splits_four_processes(world4, case, layers):
    check_split(world4, case, layers)
