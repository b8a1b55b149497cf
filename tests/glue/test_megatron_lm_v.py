"""Megatron-LM's own `pretrain_gpt.py` on model chunks in a V (`--terapipe-virtual-placement v`).

Megatron has no V schedule, and a model built in chunks starts from other weights than the same
flags in one chunk per stage, so each row compares on one model through a checkpoint: a job of
4 untied layers on PP=2 stops after iteration 2 with a checkpoint (`torch_dist`, Megatron's
distributed format) under one layout, and is resumed (iterations 3 and 4, then a validation)
under the V and under `1f1b`. The V must log the lm loss and grad norm of `1f1b` at both
iterations, and the same validation loss (relative 1e-5). Rows: the base model, 8
microbatches on the planner's own V plan, 6 layers (a stage's 3 in unequal chunks of 2 and 1), TP=2, per-token loss, MoE with its router losses
(logged, equal too), DP=2 with the distributed optimizer and overlapped grad reduce, bf16 and
fp16 (relative 1e-3: each side rounds its own sums), and a checkpoint the V saved resumed under
`1f1b`. `auto` within a V the flags fix trains as the V on
one fixed plan from the same start. What a V cannot run yet stops at start-up naming the
flag. Runs only with a Megatron-LM checkout
(`MEGATRON_LM_PATH`) and `triton`, `pybind11` and `psutil` installed; marked `slow`.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

import pytest

from harness.megatron_lm import CHECKOUT, Pretrain, needs_checkout, pretrain
from harness.spawn import free_port

pytestmark = needs_checkout(
    pytest.mark.skipif(importlib.util.find_spec("psutil") is None,
                       reason="Megatron-Core's checkpoint writer needs psutil: pip install psutil"))

ITERATIONS = 4
MODEL = ["--num-layers", "4", "--untie-embeddings-and-output-weights"]
V = ["--pipeline-schedule", "terapipe", "--terapipe-virtual-placement", "v",
     "--num-virtual-stages-per-pipeline-rank", "2"]
LAYOUTS = {"1f1b": ["--pipeline-schedule", "1f1b"], "v": V}
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--disable-bias-linear")  # as the matrix runs MoE (test_megatron_lm_configs.py)
IN_A_V = "> terapipe: model chunks in a V (--terapipe-virtual-placement v)"


@dataclass(frozen=True)
class Row:
    name: str
    nproc: int
    flags: tuple[str, ...] = ()
    v_flags: tuple[str, ...] = ("--terapipe-num-slices", "4")  # given to the V's runs only
    v_log_has: tuple[str, ...] = ("token slices (all rows) ... 16 16 16 16",)
    # Without Apex or Transformer Engine (so on CPU) Megatron-Core cannot load a distributed
    # optimizer's state (DistributedOptimizer.state_dict asserts one Adam step count over an
    # empty state), under 1f1b too: such rows resume the weights, with a fresh optimizer on
    # both sides (--no-save-optim, --no-load-optim).
    optimizer_in_checkpoint: bool = True
    moe_logs: tuple[str, ...] = ()  # the MoE losses both runs' iteration lines must carry
    # lm loss and grad norm against 1f1b's; in bf16 / fp16 each side rounds its own sums (the
    # matrix's bf16 rows, test_megatron_lm_configs.py, take 1e-3 too)
    rel: float = 1e-5


def run(row: Row, layout: str, flags: list[str]) -> Pretrain:
    extra = list(row.v_flags) if layout == "v" else []
    result = pretrain(CHECKOUT, row.nproc, [*MODEL, *row.flags, *LAYOUTS[layout], *extra,
                                            *flags], free_port(), iterations=ITERATIONS,
                      timeout=900)
    assert result.returncode == 0, result.log[-4000:]
    if layout == "v":
        for text in (IN_A_V, *row.v_log_has):
            assert text in result.log, result.log[-4000:]
    return result


def save_at_iteration_2(row: Row, layout: str, directory: str) -> Pretrain:
    no_optimizer = [] if row.optimizer_in_checkpoint else ["--no-save-optim"]
    saved = run(row, layout, ["--save", directory, "--save-interval", "2", "--exit-interval", "2",
                              *no_optimizer])
    assert [i for i, _, _ in saved.iterations] == [1, 2], saved.log[-4000:]
    assert "successfully saved checkpoint from iteration       2" in saved.log, saved.log[-4000:]
    return saved


def resume(row: Row, layout: str, directory: str) -> Pretrain:
    no_optimizer = [] if row.optimizer_in_checkpoint else ["--no-load-optim"]
    resumed = run(row, layout, ["--load", directory, *no_optimizer])
    assert "successfully loaded checkpoint from" in resumed.log, resumed.log[-4000:]
    # a strict load: Megatron-LM falls back to a non-strict one (and prints what it returned)
    # when the model's keys do not match the checkpoint's
    assert "load_return:" not in resumed.log, resumed.log[-4000:]
    assert [i for i, _, _ in resumed.iterations] == [3, 4], resumed.log[-4000:]
    return resumed


def assert_same_training(ours: Pretrain, theirs: Pretrain, moe_logs: tuple = (),
                         rel: float = 1e-5) -> None:
    assert ours.iterations and len(ours.iterations) == len(theirs.iterations)
    for (i, loss, norm), (_, ref_loss, ref_norm) in zip(ours.iterations, theirs.iterations):
        assert loss == pytest.approx(ref_loss, rel=rel), f"iteration {i} lm loss"
        assert norm == pytest.approx(ref_norm, rel=rel), f"iteration {i} grad norm"
    assert ours.validation and ours.validation == pytest.approx(theirs.validation, rel=rel)
    for i, (mine, ref) in enumerate(zip(ours.moe_losses, theirs.moe_losses), start=3):
        assert set(moe_logs) <= set(ref) and set(moe_logs) <= set(mine), (mine, ref)
        assert mine == pytest.approx(ref, rel=1e-5), f"iteration {i} MoE losses"
    assert len(ours.moe_losses) == len(ours.iterations)


ROWS = [
    Row("base", 2),
    Row("8 microbatches, the planner's V plan", 2, ("--global-batch-size", "8"), v_flags=(),
        v_log_has=("DP slicer (granularity 8), simulator-checked, on 2 virtual stages per "
                   "rank in a V",)),
    Row("TP=2", 4, ("--tensor-model-parallel-size", "2")),
    Row("per-token loss", 2, ("--calculate-per-token-loss",)),
    Row("MoE + aux loss + z-loss", 2, (*MOE, "--moe-aux-loss-coeff", "1e-2",
                                       "--moe-z-loss-coeff", "1e-3"),
        moe_logs=("load_balancing_loss", "z_loss")),
    Row("DP=2 + distributed optimizer + overlapped grad reduce", 4,
        ("--use-distributed-optimizer", "--overlap-grad-reduce"), optimizer_in_checkpoint=False),
    Row("6 layers: chunks of 2 and 1 layers", 2, ("--num-layers", "6"),
        v_log_has=("a stage's 3 layers in chunks of 2 (down) and 1 (back)",
                   "token slices (all rows) ... 16 16 16 16")),
    Row("bf16", 2, ("--bf16",), rel=1e-3),
    Row("fp16, static loss scale", 2, ("--fp16", "--loss-scale", "1024"), rel=1e-3),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_a_v_resuming_a_1f1b_checkpoint_trains_as_1f1b(tmp_path, row):
    directory = str(tmp_path / "checkpoint")
    save_at_iteration_2(row, "1f1b", directory)
    assert_same_training(resume(row, "v", directory), resume(row, "1f1b", directory),
                         row.moe_logs, row.rel)


def test_a_checkpoint_of_the_v_resumes_under_1f1b(tmp_path):
    row = ROWS[0]
    directory = str(tmp_path / "checkpoint")
    save_at_iteration_2(row, "v", directory)
    assert_same_training(resume(row, "1f1b", directory), resume(row, "v", directory))


@pytest.mark.parametrize("flags, says", [
    (("--num-layers", "4"), "add --untie-embeddings-and-output-weights"),
    ((*MODEL, "--mtp-num-layers", "1", "--position-embedding-type", "rope"),
     "--terapipe-virtual-placement v does not run with --mtp-num-layers yet"),
], ids=["tied embeddings", "mtp"])
def test_what_a_v_cannot_run_stops_at_start_up(flags, says):
    result = pretrain(CHECKOUT, 2, [*flags, *V], free_port(), timeout=300)
    assert result.returncode != 0 and not result.started_training, result.log[-4000:]
    assert "megatron_terapipe.megatron.launch: error: --terapipe-virtual-placement v" in \
        result.log and says in result.log, result.log[-4000:]


def test_auto_within_a_v_trains_as_the_v():
    """`--pipeline-schedule auto` with the V fixed by the flags times TeraPipe's V plans
    (Megatron has no V, so none of its schedules) and keeps one; over 36 iterations every lm
    loss and grad norm equals a run of the V on one fixed plan from the same start."""
    flags = [*MODEL, "--global-batch-size", "8", "--terapipe-hardware", "h100",
             "--num-virtual-stages-per-pipeline-rank", "2", "--terapipe-virtual-placement", "v"]
    ours = pretrain(CHECKOUT, 2, [*flags, "--pipeline-schedule", "auto"], free_port(),
                    iterations=36, timeout=900)
    assert ours.returncode == 0, ours.log[-4000:]
    assert "schedules on 2 model chunks per stage in a V" in ours.log, ours.log[-4000:]
    tried = set(re.findall(r"^terapipe auto: trial (.+): [0-9.]+ ms measured", ours.log, re.M))
    assert len(tried) >= 2 and all("in a V" in name for name in tried), tried
    kept = re.findall(r"^terapipe auto: keeping (.+) \(no Megatron schedule", ours.log, re.M)
    assert len(kept) == 1 and kept[0] in tried, ours.log[-4000:]
    theirs = pretrain(CHECKOUT, 2, [*flags, "--pipeline-schedule", "terapipe",
                                    "--terapipe-num-slices", "1"], free_port(), iterations=36,
                      timeout=900)
    assert theirs.returncode == 0, theirs.log[-4000:]
    assert [i for i, _, _ in ours.iterations] == list(range(1, 37))
    assert_same_training(ours, theirs)
