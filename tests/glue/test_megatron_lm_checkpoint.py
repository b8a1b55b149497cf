"""Checkpoints of Megatron-LM's own `pretrain_gpt.py` on CPU (`--terapipe-cpu`, the default
`torch_dist` format), and switching a job between schedules at a checkpoint.

A 4-iteration job (harness/megatron_lm.py's model, PP=2) stops after iteration 2 with a
checkpoint (`--save DIR --save-interval 2 --exit-interval 2`) under one schedule and is resumed
(`--load DIR`: iterations 3 and 4, then a validation) under the other. It must log the same lm
loss and grad norm at both iterations, and the same validation loss, as the same resume under
the schedule that saved (relative 1e-5), in both directions (1f1b -> terapipe, terapipe -> 1f1b).
The resumed job is also the uninterrupted one: the same iterations 3 and 4 as a 4-iteration run
that never stopped. A layout change at a checkpoint: a 1f1b checkpoint without chunks resumes
under `auto` on 2 chunks per stage with the losses of Megatron's interleaved schedule resuming
it. Runs only with a Megatron-LM checkout (`MEGATRON_LM_PATH`) and `triton`,
`pybind11` and `psutil` installed; marked `slow`.
"""

from __future__ import annotations

import importlib.util

import pytest

from harness.megatron_lm import CHECKOUT, Pretrain, needs_checkout, pretrain
from harness.spawn import free_port

pytestmark = needs_checkout(
    pytest.mark.skipif(importlib.util.find_spec("psutil") is None,
                       reason="Megatron-Core's checkpoint writer needs psutil: pip install psutil"))

ITERATIONS = 4
SCHEDULES = {"1f1b": ["--pipeline-schedule", "1f1b"],
             "terapipe": ["--pipeline-schedule", "terapipe", "--terapipe-num-slices", "4"]}
TERAPIPE_RAN = "token slices (all rows) ... 16 16 16 16"


def run(schedule: str, flags: list[str]) -> Pretrain:
    result = pretrain(CHECKOUT, 2, [*SCHEDULES[schedule], *flags], free_port(),
                      iterations=ITERATIONS, timeout=900)
    assert result.returncode == 0, result.log[-4000:]
    if schedule == "terapipe":
        assert TERAPIPE_RAN in result.log, result.log[-4000:]
    return result


def save_at_iteration_2(schedule: str, directory: str) -> Pretrain:
    saved = run(schedule, ["--save", directory, "--save-interval", "2", "--exit-interval", "2"])
    assert [i for i, _, _ in saved.iterations] == [1, 2], saved.log[-4000:]
    assert "successfully saved checkpoint from iteration       2" in saved.log, saved.log[-4000:]
    return saved


def resume(schedule: str, directory: str) -> Pretrain:
    resumed = run(schedule, ["--load", directory])
    assert "successfully loaded checkpoint from" in resumed.log, resumed.log[-4000:]
    assert [i for i, _, _ in resumed.iterations] == [3, 4], resumed.log[-4000:]
    return resumed


def iteration_losses(run_: Pretrain) -> list[float]:
    """Each iteration's own lm loss. Megatron-LM does not reset its loss sums after the first
    iteration a process logs, so a run's second logged loss is the mean of its first two."""
    logged = [loss for _, loss, _ in run_.iterations]
    return logged[:1] + [2 * logged[1] - logged[0]] + logged[2:]


@pytest.fixture(scope="module")
def uninterrupted() -> Pretrain:
    return run("1f1b", [])


@pytest.mark.parametrize("saver, resumer", [("1f1b", "terapipe"), ("terapipe", "1f1b")],
                         ids=["1f1b-then-terapipe", "terapipe-then-1f1b"])
def test_a_job_resumes_under_the_other_schedule(tmp_path, uninterrupted, saver, resumer):
    directory = str(tmp_path / "checkpoint")
    save_at_iteration_2(saver, directory)
    switched = resume(resumer, directory)
    same = resume(saver, directory)
    for (i, loss, norm), (_, ref_loss, ref_norm) in zip(switched.iterations, same.iterations):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"iteration {i} lm loss"
        assert norm == pytest.approx(ref_norm, rel=1e-5), f"iteration {i} grad norm"
    assert switched.validation and switched.validation == pytest.approx(same.validation, rel=1e-5)
    # The checkpoint holds the whole job: the resume continues the run that never stopped.
    assert iteration_losses(switched) == pytest.approx(iteration_losses(uninterrupted)[2:],
                                                       rel=1e-5)
    assert [n for _, _, n in switched.iterations] == \
        pytest.approx([n for _, _, n in uninterrupted.iterations[2:]], rel=1e-5)
    assert switched.validation == pytest.approx(uninterrupted.validation, rel=1e-5)


#: 4 layers in 2 model chunks per stage, as the flags fix them
CHUNKED = ["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2"]


def test_a_checkpoint_without_chunks_resumes_under_auto_on_two_chunks(tmp_path):
    """A layout change at a checkpoint: a 1f1b job of 4 layers in one chunk per stage saves at
    iteration 2; `auto` resumes it on 2 chunks per stage (Megatron's distributed checkpoint
    reshards the layers into chunks) and logs the lm loss, grad norm and validation loss of
    Megatron's interleaved schedule resuming the same checkpoint (relative 1e-5)."""
    directory = str(tmp_path / "checkpoint")
    saved = pretrain(CHECKOUT, 2, ["--pipeline-schedule", "1f1b", "--num-layers", "4", "--save",
                                   directory, "--save-interval", "2", "--exit-interval", "2"],
                     free_port(), iterations=ITERATIONS, timeout=900)
    assert saved.returncode == 0 and [i for i, _, _ in saved.iterations] == [1, 2], saved.log[-4000:]
    resumed = {}
    for schedule in ("auto", "1f1b"):
        run_ = pretrain(CHECKOUT, 2, ["--pipeline-schedule", schedule, *CHUNKED, "--load",
                                      directory], free_port(), iterations=ITERATIONS, timeout=900)
        assert run_.returncode == 0, run_.log[-4000:]
        assert "successfully loaded checkpoint from" in run_.log, run_.log[-4000:]
        assert [i for i, _, _ in run_.iterations] == [3, 4], run_.log[-4000:]
        resumed[schedule] = run_
    ours, theirs = resumed["auto"], resumed["1f1b"]
    assert "terapipe auto:" in ours.log, ours.log[-4000:]
    for (i, loss, norm), (_, ref_loss, ref_norm) in zip(ours.iterations, theirs.iterations):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"iteration {i} lm loss"
        assert norm == pytest.approx(ref_norm, rel=1e-5), f"iteration {i} grad norm"
    assert ours.validation and ours.validation == pytest.approx(theirs.validation, rel=1e-5)
