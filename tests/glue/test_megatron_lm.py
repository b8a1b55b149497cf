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

import pytest

from harness import megatron_lm
from harness.megatron_lm import CHECKOUT, needs_checkout
from harness.spawn import free_port

pytestmark = needs_checkout()


def pretrain(schedule: list[str]):
    run = megatron_lm.pretrain(CHECKOUT, 2, schedule, free_port(), iterations=5, timeout=900)
    assert run.returncode == 0, run.log[-4000:]
    assert len(run.iterations) == 5, run.log[-4000:]
    return run.iterations, run.validation


def test_pretrain_gpt_terapipe_equals_1f1b_on_cpu():
    ours, ours_valid = pretrain(["--pipeline-schedule", "terapipe", "--terapipe-num-slices", "4"])
    theirs, theirs_valid = pretrain(["--pipeline-schedule", "1f1b"])
    assert [i for i, _, _ in ours] == [1, 2, 3, 4, 5]
    for (i, loss, norm), (_, ref_loss, ref_norm) in zip(ours, theirs):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"iteration {i}"
        assert norm == pytest.approx(ref_norm, rel=1e-5), f"iteration {i}"
    assert ours_valid and ours_valid == pytest.approx(theirs_valid, rel=1e-5)
