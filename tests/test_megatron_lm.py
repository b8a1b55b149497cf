"""Megatron-LM's own, unmodified `pretrain_gpt.py` through the launcher, on CPU.

Runs only where a Megatron-LM checkout is given: `MEGATRON_LM_PATH=/path/to/Megatron-LM` (the
tag matching the installed megatron-core, e.g. core_v0.16.1). Megatron-LM's training modules
themselves need `triton` importable and `pybind11` (its dataset helpers are compiled at
start-up): `pip install triton pybind11`. Two processes, PP=2, mock data, a small GPT, fp32:
`--pipeline-schedule terapipe` with 4 token slices and `--pipeline-schedule 1f1b` (Megatron's
own schedule) must log the same loss and grad norm at every iteration (relative 1e-5), and the
validation loss too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

CHECKOUT = os.environ.get("MEGATRON_LM_PATH")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHECKOUT, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout "
                       "to run its pretrain_gpt.py"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="Megatron-LM's training modules import triton: pip install triton"),
]

MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "5",
         "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "5",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--clip-grad", "0.0",
         "--pipeline-model-parallel-size", "2", "--terapipe-cpu"]

ITERATION = re.compile(r"iteration\s+(\d+)/.*lm loss: ([0-9.E+-]+).*grad norm: ([0-9.]+)")
VALIDATION = re.compile(r"validation loss at iteration \d+ on validation set \| lm loss value: ([0-9.E+-]+)")


def pretrain(schedule: list[str], port: int) -> tuple[list[tuple[int, float, float]], list[float]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([CHECKOUT, ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(port), "-m", "megatron_terapipe.megatron.launch",
           os.path.join(CHECKOUT, "pretrain_gpt.py"), *MODEL, *schedule]
    out = subprocess.run(cmd, cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    iterations = [(int(i), float(loss), float(norm)) for i, loss, norm in ITERATION.findall(log)]
    assert len(iterations) == 5, log[-4000:]
    return iterations, [float(v) for v in VALIDATION.findall(log)]


def test_pretrain_gpt_terapipe_equals_1f1b_on_cpu():
    ours, ours_valid = pretrain(["--pipeline-schedule", "terapipe", "--terapipe-num-slices", "4"], 29641)
    theirs, theirs_valid = pretrain(["--pipeline-schedule", "1f1b"], 29643)
    assert [i for i, _, _ in ours] == [1, 2, 3, 4, 5]
    for (i, loss, norm), (_, ref_loss, ref_norm) in zip(ours, theirs):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"iteration {i}"
        assert norm == pytest.approx(ref_norm, rel=1e-5), f"iteration {i}"
    assert ours_valid and ours_valid == pytest.approx(theirs_valid, rel=1e-5)
