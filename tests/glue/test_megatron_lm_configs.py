"""Megatron-LM's real configurations: `--pipeline-schedule terapipe` against `1f1b`.

Megatron-LM's own, unmodified `pretrain_gpt.py` through the launcher on CPU (`--terapipe-cpu`),
PP=2, mock data, a small fp32 GPT (harness/megatron_lm.py), 3 iterations and one validation.
For each configuration TeraPipe (4 token slices) either logs the same lm loss and grad norm as
Megatron's own schedule at every iteration and the same validation loss (relative 1e-5; bf16
rows 1e-3), or
stops before its first iteration with TeraPipe's argument error naming the flag and the way
out; two runs with the planner's own plans, whose W actions it places; and one with edge
slicing by hand (--terapipe-edge-slices); and two with --pipeline-schedule auto, whose trials
switch schedules between iterations, over 36 iterations. Runs only with a
Megatron-LM checkout (`MEGATRON_LM_PATH`, core_v0.16.1, core_v0.17.1, core_v0.18.2 or
core_v0.19.0) and `triton` + `pybind11` installed; marked `slow`. docs/megatron-lm.md has the table of
results.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from harness.megatron_lm import CHECKOUT, needs_checkout, pretrain
from harness.spawn import free_port
from megatron_terapipe.megatron.platform import router_versions

pytestmark = needs_checkout()

TERAPIPE = ["--pipeline-schedule", "terapipe", "--terapipe-num-slices", "4"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       # Megatron's local experts add their bias in place on a view: it fails with biases on
       # either schedule, so MoE runs as MoE models usually do, without linear biases.
       "--disable-bias-linear"]


@dataclass(frozen=True)
class Config:
    name: str
    nproc: int
    flags: tuple[str, ...]
    moe_logs: tuple[str, ...] = ()  # the MoE losses its iteration lines must carry
    log_has: tuple[str, ...] = ()  # what TeraPipe's start-up report must say besides
    terapipe_flags: tuple[str, ...] = ()  # given to TeraPipe's run only
    # lm loss and grad norm (logged with 3 decimals) against 1f1b's; bf16 rounds each side's
    # sums to 8 mantissa bits (measured: losses 1.3e-5 apart, norms equal as logged)
    rel: float = 1e-5


EQUAL = [
    Config("plain (learned absolute positions)", 2, ()),
    Config("2-sample microbatches", 2, ("--micro-batch-size", "2", "--global-batch-size", "8")),
    Config("rope", 2, ("--position-embedding-type", "rope", "--no-rope-fusion")),
    Config("GQA + SwiGLU + RMSNorm + untied embeddings", 2,
           ("--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization",
            "RMSNorm", "--untie-embeddings-and-output-weights")),
    Config("packed sequences", 2, ("--reset-position-ids", "--reset-attention-mask",
                                   "--eod-mask-loss")),
    # the report names the recomputation: full is priced (a note), selective is not (a warning)
    Config("full recompute", 2, ("--recompute-granularity", "full", "--recompute-method",
                                 "uniform", "--recompute-num-layers", "1"),
           log_has=(">   note: activation recomputation (--recompute-granularity full "
                    "--recompute-method uniform --recompute-num-layers 1): predicted times "
                    "include the recomputed forwards and memory counts what it keeps",)),
    Config("selective recompute", 2, ("--recompute-granularity", "selective"),
           log_has=("> terapipe: WARNING: activation recomputation (--recompute-granularity "
                    "selective", "is not modelled")),
    Config("TP=2", 4, ("--tensor-model-parallel-size", "2")),
    Config("TP=2 + sequence parallel", 4, ("--tensor-model-parallel-size", "2",
                                           "--sequence-parallel")),
    Config("TP=2 + scatter-gather messages", 4, ("--tensor-model-parallel-size", "2"),
           log_has=("> terapipe: stage-to-stage messages in 2 TP parts, all-gathered by the "
                    "receiving stage (--terapipe-scatter-gather-p2p)",
                    "TP=2, scatter-gather messages"),
           terapipe_flags=("--terapipe-scatter-gather-p2p",)),
    Config("DP=2", 4, ()),
    Config("DP=2 + overlapped grad reduce", 4, ("--overlap-grad-reduce",)),
    Config("DP=2 + distributed optimizer", 4, ("--use-distributed-optimizer",)),
    Config("DP=2 + distributed optimizer + overlapped reduce and param gather", 4,
           ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")),
    Config("bf16", 2, ("--bf16",), rel=1e-3),
    Config("bf16, DP=2 + distributed optimizer", 4, ("--bf16", "--use-distributed-optimizer"),
           rel=1e-3),
    Config("MoE (4 experts, top-2, alltoall)", 2, tuple(MOE)),
    Config("MoE + aux-loss-free balancing (expert bias)", 2,
           (*MOE, "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid")),
    Config("MoE, DP=2 x EP=2", 4, (*MOE, "--expert-model-parallel-size", "2")),
    # Virtual stages: TeraPipe's cells on Megatron's model chunks, against its interleaved 1F1B
    Config("virtual pipeline (PP=2 x V=2)", 2, ("--num-layers", "4",
                                                "--num-layers-per-virtual-pipeline-stage", "1")),
    Config("virtual pipeline (PP=4 x V=2)", 4, ("--num-layers", "8", "--pipeline-model-parallel-"
                                                "size", "4", "--num-virtual-stages-per-pipeline-"
                                                "rank", "2")),
    # Megatron's microbatch groups: 8 microbatches in 2 groups of 4 on both schedules
    Config("virtual pipeline, microbatch groups of 4", 2, (
        "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
        "--global-batch-size", "8", "--microbatch-group-size-per-virtual-pipeline-stage", "4"),
           log_has=(">   virtual stages ............ 2 model chunks per stage, microbatches in "
                    "groups of 4", ">   note: microbatch groups of 4 from "
                    "--microbatch-group-size-per-virtual-pipeline-stage")),
    # Uneven splits of the layers over the stages (the planner prices the busiest stage)
    Config("uneven first stage (1 of 4 layers)", 2, ("--num-layers", "4",
                                                     "--decoder-first-pipeline-num-layers", "1")),
    Config("pipeline layout Et|ttt,L", 2, ("--num-layers", "4",
                                           "--pipeline-model-parallel-layout", "Et|ttt,L")),
    Config("embedding and loss counted in the split", 2, (
        "--num-layers", "4", "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split")),
]

#: MoE router losses: equal to Megatron's on the megatron-core lines whose losses TeraPipe
#: reproduces (model/moe_router_losses.py), refused with the flags named elsewhere.
MOE_LOSSES = [
    (Config("MoE + load-balancing loss (aux_loss)", 2, (*MOE, "--moe-aux-loss-coeff", "1e-2"),
            ("load_balancing_loss",)), "--moe-aux-loss-coeff"),
    (Config("MoE + seq_aux_loss", 2, (*MOE, "--moe-router-load-balancing-type", "seq_aux_loss",
                                      "--moe-aux-loss-coeff", "1e-2"),
            ("seq_load_balancing_loss",)), "--moe-aux-loss-coeff"),
    (Config("MoE + global_aux_loss", 2, (*MOE, "--moe-router-load-balancing-type",
                                         "global_aux_loss", "--moe-aux-loss-coeff", "1e-2"),
            ("global_load_balancing_loss",)), "--moe-aux-loss-coeff"),
    (Config("MoE + z-loss", 2, (*MOE, "--moe-z-loss-coeff", "1e-3"), ("z_loss",)),
     "--moe-z-loss-coeff"),
    (Config("MoE + all three load-balancing losses + z-loss, DP=2 x EP=2", 4,
            (*MOE, "--expert-model-parallel-size", "2", "--moe-router-load-balancing-type",
             "aux_loss", "seq_aux_loss", "global_aux_loss", "--moe-aux-loss-coeff", "1e-2",
             "1e-2", "1e-2", "--moe-z-loss-coeff", "1e-3"),
            ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
             "z_loss")), "--moe-aux-loss-coeff"),
    # TeraPipe's cells on Megatron's model chunks against its interleaved 1F1B, with every loss
    (Config("MoE + all three load-balancing losses + z-loss, virtual pipeline (PP=2 x V=2)", 2,
            (*MOE, "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
             "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "global_aux_loss",
             "--moe-aux-loss-coeff", "1e-2", "1e-2", "1e-2", "--moe-z-loss-coeff", "1e-3"),
            ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
             "z_loss"), log_has=(">   virtual stages ............ 2 model chunks per stage",)),
     "--moe-aux-loss-coeff"),
]
if router_versions.line_problem() is None:
    EQUAL += [config for config, _ in MOE_LOSSES]

#: (configuration, what TeraPipe's error must say, whether Megatron's 1f1b trains it on CPU:
#: context parallelism needs Transformer Engine's attention, which the CPU has not)
REFUSED = [
    (Config("CP=2", 4, ("--context-parallel-size", "2")), "--context-parallel-size", False),
    # chunks of 1 and 2 layers: TeraPipe's virtual stages need equal chunks (Megatron's
    # interleaved schedule on CPU is not what this row checks)
    (Config("virtual pipeline on an uneven layout", 2, (
        "--num-layers", "6", "--pipeline-model-parallel-layout", "Et|tt|tt|tL")),
     "--pipeline-model-parallel-layout", False),
    (Config("MoE + capacity factor", 2, (*MOE, "--moe-expert-capacity-factor", "1.0")),
     "--moe-expert-capacity-factor 1.0", True),
    (Config("MoE + Sinkhorn routing", 2, (*MOE, "--moe-router-load-balancing-type", "sinkhorn",
                                         "--moe-router-topk", "1")), "sinkhorn", True),
    # an attention sink: Megatron's core attention adds a learned offset to the softmax
    (Config("attention sink", 2, ("--softmax-type", "learnable")), "--softmax-type learnable", True),
]
if router_versions.line_problem() is not None:
    REFUSED += [(config, flag, True) for config, flag in MOE_LOSSES]


#: The planner's own plans (no fixed slices): the analytic H100 model places the W actions of
#: this small model's plans in the stages' waits (--terapipe-wgrad-placement auto, the default)
PLANNED = [
    Config("planned, W placed (8 microbatches)", 2, (
        "--num-layers", "4", "--global-batch-size", "8", "--terapipe-hardware", "h100")),
    Config("planned, virtual pipeline (PP=2 x V=2), W placed", 2, (
        "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
        "--global-batch-size", "8", "--terapipe-hardware", "h100")),
]


@pytest.mark.parametrize("config", EQUAL, ids=[c.name for c in EQUAL])
def test_terapipe_equals_1f1b(config):
    ours = pretrain(CHECKOUT, config.nproc, [*config.flags, *TERAPIPE, *config.terapipe_flags],
                    free_port())
    assert ours.returncode == 0, ours.log[-4000:]
    assert "token slices (all rows) ... 16 16 16 16" in ours.log, ours.log[-4000:]  # TeraPipe ran
    for text in config.log_has:
        assert text in ours.log, ours.log[-4000:]
    _assert_equal_to_1f1b(config, ours)


@pytest.mark.parametrize("config", PLANNED, ids=[c.name for c in PLANNED])
def test_planned_w_places_equal_1f1b(config):
    ours = pretrain(CHECKOUT, config.nproc, [*config.flags, "--pipeline-schedule", "terapipe"],
                    free_port())
    assert ours.returncode == 0, ours.log[-4000:]
    assert "W actions placed in the stages' waits" in ours.log, ours.log[-4000:]
    _assert_equal_to_1f1b(config, ours)


EDGE = Config("edge slicing by hand (8 microbatches)", 2, ("--global-batch-size", "8"))


def test_edge_slices_equal_1f1b():
    """Whole sequences with the first 2 microbatches cut into 4 slices and the last into 2
    (--terapipe-edge-slices), equal to Megatron's 1F1B."""
    flags = ["--pipeline-schedule", "terapipe", "--terapipe-edge-slices", "2", "4", "1", "2"]
    ours = pretrain(CHECKOUT, EDGE.nproc, [*EDGE.flags, *flags], free_port())
    assert ours.returncode == 0, ours.log[-4000:]
    for line in ("first 2 microbatches ...... 16 16 16 16", "last 1 microbatches ...... 32 32",
                 "token slices (all rows) ... 64"):
        assert line in ours.log, ours.log[-4000:]
    _assert_equal_to_1f1b(EDGE, ours)


SLICE_AWARE = Config("1f1b on the slice-aware model", 2, ())


def test_megatrons_schedule_on_the_slice_aware_model_equals_1f1b():
    """--terapipe-slice-aware-model: Megatron's 1F1B on GPT models with TeraPipe's attention
    (the like-for-like side of a comparison) trains as Megatron's own model does."""
    ours = pretrain(CHECKOUT, SLICE_AWARE.nproc, ["--pipeline-schedule", "1f1b",
                                                  "--terapipe-slice-aware-model"], free_port())
    assert ours.returncode == 0, ours.log[-4000:]
    assert "on GPT models built with TeraPipe's slice-aware attention" in ours.log
    assert "GPT model layers built with slice-aware core attention" in ours.log
    assert "token slices" not in ours.log, ours.log[-4000:]  # Megatron's schedule ran
    _assert_equal_to_1f1b(SLICE_AWARE, ours)


def _assert_equal_to_1f1b(config: Config, ours) -> None:
    """Megatron's own schedule on the same flags: every iteration's lm loss and grad norm, the
    validation loss and the MoE losses equal to `ours` (relative `config.rel`)."""
    theirs = pretrain(CHECKOUT, config.nproc, [*config.flags, "--pipeline-schedule", "1f1b"],
                      free_port())
    assert theirs.returncode == 0, theirs.log[-4000:]
    assert [i for i, _, _ in ours.iterations] == [1, 2, 3], ours.log[-4000:]
    for (i, loss, norm), (_, ref_loss, ref_norm) in zip(ours.iterations, theirs.iterations):
        assert loss == pytest.approx(ref_loss, rel=config.rel), f"iteration {i} loss"
        assert norm == pytest.approx(ref_norm, rel=config.rel), f"iteration {i} grad norm"
    assert ours.validation and ours.validation == pytest.approx(theirs.validation, rel=config.rel)
    for i, (mine, ref) in enumerate(zip(ours.moe_losses, theirs.moe_losses), start=1):
        # megatron-core 0.19's tracker also prints, as 0, the names its training log tracks
        # from --moe-router-load-balancing-type by substring ("aux_loss" in "seq_aux_loss")
        assert sorted(mine) == sorted(ref), f"iteration {i}: {mine} against {ref}"
        assert set(config.moe_logs) <= set(ref), f"iteration {i}: {ref}"
        assert all(ref[name] == 0 for name in set(ref) - set(config.moe_logs)), ref
        assert mine == pytest.approx(ref, rel=1e-5), f"iteration {i} MoE losses"


@pytest.mark.parametrize("config, flag, megatron_trains", REFUSED,
                         ids=[c.name for c, _, _ in REFUSED])
def test_terapipe_refuses_before_training(config, flag, megatron_trains):
    run = pretrain(CHECKOUT, config.nproc, [*config.flags, *TERAPIPE], free_port(), timeout=300)
    assert run.returncode != 0, run.log[-4000:]
    assert not run.started_training, run.log[-4000:]
    prefix = "megatron_terapipe.megatron.launch: error: "
    errors = [line for line in run.log.splitlines() if line.startswith(prefix)]
    # once, by rank 0, with no traceback of ours (torchrun still reports the failed ranks)
    assert len(errors) == 1 and "TeraPipeArgumentError" not in run.log, run.log[-4000:]
    message = errors[0][len(prefix):]
    assert flag in message and "--pipeline-schedule 1f1b" in message, message
    if megatron_trains:  # the refusal is TeraPipe's own, not the CPU route's
        theirs = pretrain(CHECKOUT, config.nproc, [*config.flags, "--pipeline-schedule", "1f1b"],
                          free_port())
        assert theirs.returncode == 0 and len(theirs.iterations) == 3, theirs.log[-4000:]


#: --pipeline-schedule auto that measures: its trials switch schedules between iterations
#: (Megatron's among them) and it keeps one; every iteration's loss and grad norm equal to a
#: plain 1f1b run's. 36 iterations hold the trials (at most 5 candidates x 3, 5 for the
#: re-planned one, and a runoff of at most 3 x 4).
AUTO = [
    Config("auto, 8 microbatches", 2, ("--global-batch-size", "8", "--terapipe-hardware", "h100")),
    Config("auto within virtual stages (PP=2 x V=2), 8 microbatches", 2, (
        "--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
        "--global-batch-size", "8", "--terapipe-hardware", "h100"),
           log_has=("Megatron interleaved, 2 chunks",)),
]
AUTO_ITERATIONS = 36
TRIAL_LINE = re.compile(r"^terapipe auto: trial (.+): [0-9.]+ ms measured, .+ predicted$", re.M)


@pytest.mark.parametrize("config", AUTO, ids=[c.name for c in AUTO])
def test_auto_trials_train_as_1f1b(config):
    ours = pretrain(CHECKOUT, config.nproc, [*config.flags, "--pipeline-schedule", "auto"],
                    free_port(), iterations=AUTO_ITERATIONS)
    assert ours.returncode == 0, ours.log[-4000:]
    tried = set(TRIAL_LINE.findall(ours.log))
    assert len(tried) >= 2 and any(name.startswith("Megatron") for name in tried), tried
    kept = re.findall(r"^terapipe auto: keeping (.+) \([0-9.]+x Megatron", ours.log, re.M)
    assert len(kept) == 1 and kept[0] in tried, ours.log[-4000:]
    for text in config.log_has:
        assert text in ours.log, ours.log[-4000:]
    theirs = pretrain(CHECKOUT, config.nproc, [*config.flags, "--pipeline-schedule", "1f1b"],
                      free_port(), iterations=AUTO_ITERATIONS)
    assert theirs.returncode == 0, theirs.log[-4000:]
    assert [i for i, _, _ in ours.iterations] == list(range(1, AUTO_ITERATIONS + 1))
    for (i, loss, norm), (_, ref_loss, ref_norm) in zip(ours.iterations, theirs.iterations):
        assert loss == pytest.approx(ref_loss, rel=config.rel), f"iteration {i} loss"
        assert norm == pytest.approx(ref_norm, rel=config.rel), f"iteration {i} grad norm"
    assert ours.validation and ours.validation == pytest.approx(theirs.validation, rel=config.rel)
