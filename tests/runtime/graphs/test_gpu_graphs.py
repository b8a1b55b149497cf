"""On a GPU: a stage whose every compute action replays as a torch.cuda.CUDAGraph trains like the
same stage eager (`--terapipe-cuda-graphs`; skips without CUDA).

One process, one stage (PP=1: NCCL refuses two ranks on one GPU), 4 token slices, 3 microbatches,
4 iterations with fresh batches and an in-place SGD step each (tests/harness/runs/replay_runs.py):
eager warm-up, capture of every forward, backward and W action at the second iteration, replays
after. fp32; every reported loss and every parameter gradient of the graphed run within rtol
1e-5 / atol 1e-6 of the eager run's (the same kernels on the same values; the tolerance allows
a library picking another algorithm under capture). The CPU stand-in of the same runs, exact:
tests/runtime/graphs/test_graph_replay.py.
"""

from __future__ import annotations

import pytest
import torch

from harness import GLOO_AND_NCCL, spawn
from harness.runs.replay_runs import ReplayRun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: it captures torch.cuda.CUDAGraph")

RUNS = [
    ReplayRun("pp1_defer_on", pp=1, device="cuda"),
    ReplayRun("pp1_defer_off", pp=1, defer_wgrad=False, device="cuda"),
    ReplayRun("pp1_recompute_selective", pp=1, device="cuda",
              model=(("recompute_granularity", "selective"),)),
    ReplayRun("pp1_per_token_loss_rmsnorm_gqa", pp=1, device="cuda", model=(
        ("calculate_per_token_loss", True), ("normalization", "RMSNorm"), ("num_query_groups", 2))),
]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_cuda_graph_replays_train_like_eager(run):
    # NCCL for CUDA tensors: the captured loss cell all-reduces over the TP group (GLOO_AND_NCCL)
    result = spawn(1, "harness.runs.replay_runs:replay_vs_eager", [run], timeout=600,
                   backend=GLOO_AND_NCCL)[0][run.name]
    eager, graphed = result["eager"], result["graphed"]
    for i, (e, g) in enumerate(zip(eager, graphed)):
        assert len(e["losses"]) == len(g["losses"]) == run.microbatches, (run.name, i)
        for a, b in zip(e["losses"], g["losses"]):
            assert _close(a, b), (run.name, i, a, b)
        assert e["grads"].keys() == g["grads"].keys()
        for param, grad in e["grads"].items():
            other = g["grads"][param]
            assert (grad is None) == (other is None), (run.name, i, param)
            assert grad is None or _close(grad, other), (run.name, i, param, (grad - other).abs().max())
    # per microbatch: 4 slices x (F, B), and a W when deferring; captured at the second iteration
    graphs = run.microbatches * (2 * run.slices + (1 if run.defer_wgrad else 0))
    assert [it["graphs"] for it in graphed] == [0] + [graphs] * (run.iterations - 1)
    assert graphed[-1]["replays"] == graphs * (run.iterations - 1)
