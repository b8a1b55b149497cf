"""What an iteration costs the host must not grow with the number of token slices K.

A one-stage GPT (2 layers, PP=1, one microbatch of 2 x 16 tokens; tests/harness/measured/host_cost.py)
runs K = 1, 2, 4, 8 uniform slices with the default plan. Per iteration it counts the host syncs
(`aten._local_scalar_dense`, what `.item()` and `float(t)` dispatch to: each waits for the
device on a GPU) and the gradient accumulations into parameters (post-accumulate-grad hooks),
for pretrain_gpt's (loss sum, tokens, report) loss and for the legacy (mean loss, report) one.
Controls show the counters would see growth: gradients computed in every backward cell
accumulate K times per parameter, and a loss_func that reads its token count on the host syncs
once per cell. Under Megatron DDP the linear weights' gradients accumulate inside their GEMMs
(`addmm_` into main_grad), never as a separate add.
"""

import pytest

from harness import spawn

SLICE_COUNTS = [1, 2, 4, 8]
RUNS = [{"name": "three_value", "step": "three_value"},
        {"name": "legacy", "step": "legacy"},
        {"name": "ddp", "step": "three_value", "ddp": True},
        {"name": "in_every_cell", "step": "three_value", "defer_wgrad": False},
        {"name": "syncing_loss", "step": "syncing"}]


@pytest.fixture(scope="module")
def counts():
    return spawn(1, "harness.measured.host_cost:count_host_cost", SLICE_COUNTS, RUNS, timeout=600)[0]


def _per_k(counts, run, key):
    return [counts[(run, k)][key] for k in SLICE_COUNTS]


@pytest.mark.parametrize("run", ["three_value", "legacy", "ddp"])
def test_default_plan_no_syncs_and_one_accumulation_per_parameter(counts, run):
    assert _per_k(counts, run, "syncs") == [0] * len(SLICE_COUNTS)
    params = counts[(run, 1)]["params"]
    # one sequence: each parameter accumulates exactly once, however many slices
    assert _per_k(counts, run, "accumulations") == [params] * len(SLICE_COUNTS)
    assert _per_k(counts, run, "most_per_param") == [1] * len(SLICE_COUNTS)


def test_under_ddp_linear_weights_accumulate_inside_their_gemms(counts):
    weights = counts[("ddp", 1)]["linear_weights"]
    assert weights == 9  # 4 per layer and the output layer
    assert _per_k(counts, "ddp", "main_grad_adds") == [0] * len(SLICE_COUNTS)
    assert _per_k(counts, "ddp", "main_grad_gemms") == [weights * k for k in SLICE_COUNTS]


def test_the_counters_see_growth_with_k(counts):
    params = counts[("in_every_cell", 1)]["params"]
    assert _per_k(counts, "in_every_cell", "accumulations") == [params * k for k in SLICE_COUNTS]
    assert _per_k(counts, "syncing_loss", "syncs") == SLICE_COUNTS
