"""The zero-edit launcher on a pretrain_gpt-style script, against a stand-in of Megatron-LM.

tests/standin/megatron/training stands for Megatron-LM's `megatron.training` at core_v0.16.1:
the same module and function names, the same import-time bindings (parse_args, validate_args,
get_forward_backward_func) and the same per-rank batch broadcast, on CPU with gloo. These tests
show that the launcher adds its flags to the script's parser, validates them before any model
is built, swaps in the TeraPipe schedule and gives forward_step each cell's shape.

They do not run Megatron-LM itself: not its real parser and argument checks, training loop,
datasets, model builders or CUDA paths, and not its pretrain_gpt.py (see the stand-in's
docstring for the list).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from harness.machine_lock import one_run_at_a_time
from harness.paths import ROOT, STANDIN

SCRIPT = os.path.join("tests", "standin", "pretrain_standin.py")

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "64", "--lr", "0.01", "--log-interval", "1",
         "--eval-iters", "1"]


def _env(*first):
    """A child's environment: the checkout importable, after the folders `first`."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([*first, ROOT]), OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore")


def _launch(args, nproc=2, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), "-m", "megatron_terapipe.megatron.launch", SCRIPT, *args]
    with one_run_at_a_time():  # one multi-process run at a time on the machine
        return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                              timeout=timeout)


def _free_port():
    from harness import free_port

    return free_port()


def _losses(stdout):
    return [float(x) for x in re.findall(r"iteration +\d+/ +\d+ \| lm loss: ([0-9.E+-]+) \|", stdout)]


def test_launcher_runs_the_unmodified_script_with_terapipe(tmp_path):
    trace = tmp_path / "trace.json"
    out = _launch([*MODEL, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
                   "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "terapipe",
                   "--terapipe-num-slices", "4", "--terapipe-trace", str(trace),
                   "--standin-data-seed", "11"])
    assert out.returncode == 0, out.stderr[-4000:]
    stdout = out.stdout
    assert "> terapipe: pipeline schedule terapipe" in stdout
    assert "> schedule: forward_backward_terapipe" in stdout
    assert stdout.count("> terapipe plan for seq_length 32, micro_batch_size 2, 4 microbatches, "
                        "2 pipeline stages:") == 1  # planned once, logged by rank 0 only
    assert ">   token slices (all rows) ... 8 8 8 8" in stdout
    assert re.search(r">   predicted iteration \.+ [0-9.]+ ms \(1F1B without token slices", stdout)
    assert re.search(r">   pipeline bubble \.+ [0-9.]+% \(1F1B without token slices", stdout)
    # the TeraPipe executor ran on both ranks (last call: evaluation, 4 microbatches x 4 slices)
    assert re.findall(r"terapipe actions in the last schedule call: (\d+)", stdout) == ["16", "16"]
    losses = _losses(stdout)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert "validation loss" in stdout
    measured = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in measured if e["ph"] == "X"]
    cells = [e for e in spans if e["cat"] in ("forward", "backward")]
    assert len(cells) == 2 * 2 * 4 * 4  # stages x (F, B) x slices x microbatches
    # the plan's weight-gradient mode (deferred by default) decides the W actions
    deferred = ">   weight gradients .......... deferred" in stdout
    weight_grads = [e for e in spans if e["cat"] == "weight-grad"]
    assert len(weight_grads) == (2 * 4 if deferred else 0)  # stages x sequences
    assert len(spans) == len(cells) + len(weight_grads)
    simulated = json.loads((tmp_path / "trace.simulated.json").read_text())
    assert simulated["otherData"]["num_microbatches"] == 4


def test_launcher_with_tensor_parallelism_and_the_dataset_mask():
    """TP=2: stock get_batch_on_this_tp_rank broadcasts each cell; receive buffers come from the
    global args, which hold the cell's shape while forward_step runs."""
    out = _launch([*MODEL, "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
                   "--tensor-model-parallel-size", "2", "--pipeline-schedule", "terapipe",
                   "--terapipe-slices", "16", "8", "8"])
    assert out.returncode == 0, out.stderr[-4000:]
    assert "> schedule: forward_backward_terapipe" in out.stdout
    assert ">   token slices (all rows) ... 16 8 8" in out.stdout
    assert re.findall(r"terapipe actions in the last schedule call: (\d+)", out.stdout) == ["6", "6"]
    losses = _losses(out.stdout)
    assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_bad_flags_stop_before_any_work():
    """Validation runs right after Megatron-LM's validate_args: before torch.distributed
    starts (no torchrun here: init_process_group would fail on its missing environment) and
    before any model is built."""
    cmd = [sys.executable, "-m", "megatron_terapipe.megatron.launch", SCRIPT, *MODEL,
           "--micro-batch-size", "2", "--train-iters", "2", "--pipeline-schedule", "terapipe",
           "--terapipe-slices", "16", "8"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--terapipe-slices 16 8 sum to 24 tokens but --seq-length is 32" in out.stderr
    assert "building GPT model" not in out.stdout


def test_unknown_flag_still_rejected_by_the_scripts_parser():
    cmd = [sys.executable, "-m", "megatron_terapipe.megatron.launch", SCRIPT, *MODEL,
           "--micro-batch-size", "2", "--pipeline-schedule", "zigzag"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--pipeline-schedule: invalid choice: 'zigzag'" in out.stderr


def test_launcher_usage():
    out = subprocess.run([sys.executable, "-m", "megatron_terapipe.megatron.launch"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage: python -m megatron_terapipe.megatron.launch SCRIPT" in out.stdout
    out = subprocess.run([sys.executable, "-m", "megatron_terapipe.megatron.launch", "no_such_script.py"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such script: no_such_script.py" in out.stderr


# Run with the stand-in first on the import path (its megatron.training).
INSTALL_ORDER = r"""
from megatron_terapipe.megatron.hooks import install, selection
from megatron.core.pipeline_parallel import schedules
original = schedules.get_forward_backward_func
if {install_first}:
    install.install()
    install.install()  # twice is harmless
import megatron.training.training as training  # binds get_forward_backward_func at import
if not {install_first}:
    assert training.get_forward_backward_func is original
    install.install()
import megatron.core.pipeline_parallel as pp
patched = install._terapipe_or_megatron
assert training.get_forward_backward_func is patched, training.get_forward_backward_func
assert pp.get_forward_backward_func is patched and schedules.get_forward_backward_func is patched
assert patched.__wrapped__ is original  # Megatron's own getter, kept for unselected runs
assert patched(pp_size=2, vp_size=None).__name__ == "forward_backward_pipelining_without_interleaving"
selection.select(__import__("megatron_terapipe").TeraPipePlan([16, 16]))
assert training.get_forward_backward_func().__name__ == "forward_backward_terapipe"
selection.deselect()
assert training.get_forward_backward_func(pp_size=1, vp_size=None).__name__ == "forward_backward_no_pipelining"
print("ok")
"""


@pytest.mark.parametrize("install_first", [True, False])
def test_install_before_or_after_megatron_training_import(install_first):
    code = INSTALL_ORDER.format(install_first=install_first)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(STANDIN),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# ---- the per-cell view of Megatron-LM's global args (no processes needed) -------------------
def _cell(token_start, tokens, rows=2, row_start=0):
    from megatron_terapipe.schedule import Cell

    return Cell(0, 0, 1, row_start, rows, token_start, tokens, 3)


def test_cell_args_are_the_cells_shape_and_come_back():
    from types import SimpleNamespace

    from megatron_terapipe.megatron.hooks.lm_cells import megatron_lm_cell_args

    args = SimpleNamespace(seq_length=32, micro_batch_size=4, create_attention_mask_in_dataloader=True)
    with megatron_lm_cell_args(args, _cell(8, 16, rows=2), drop_mask=True):
        assert (args.seq_length, args.micro_batch_size, args.create_attention_mask_in_dataloader) == (16, 2, False)
    assert (args.seq_length, args.micro_batch_size, args.create_attention_mask_in_dataloader) == (32, 4, True)
    with pytest.raises(RuntimeError):
        with megatron_lm_cell_args(args, _cell(0, 8), drop_mask=False):
            assert args.create_attention_mask_in_dataloader is True
            raise RuntimeError("boom")
    assert (args.seq_length, args.micro_batch_size) == (32, 4)


def test_cell_batches_drop_the_causal_mask_and_make_tensors_contiguous():
    from megatron_terapipe.runtime.batching import slice_batch
    from megatron_terapipe.megatron.hooks.lm_cells import CellBatches, is_causal_cut

    s = 32
    causal = torch.ones(s, s).tril().unsqueeze(0).unsqueeze(0).expand(2, 1, s, s) < 0.5
    tokens = torch.arange(2 * s).view(2, s)
    batch = {"tokens": tokens, "attention_mask": causal, "loss_mask": torch.ones(2, s)}
    cell = _cell(8, 16)
    cut = slice_batch(batch, cell, s, 2)
    assert not cut["tokens"].is_contiguous() and is_causal_cut(cut["attention_mask"], cell)
    out = next(CellBatches(iter([cut]), cell, must_drop_mask=True))
    assert "attention_mask" not in out and out["tokens"].is_contiguous()
    assert torch.equal(out["tokens"], tokens[:, 8:24])
    # another mask (documents reset inside the sequence): kept with TP=1, refused with TP>1
    doc = causal.clone()
    doc[:, :, 16:, :16] = True
    cut = slice_batch({"tokens": tokens, "attention_mask": doc}, cell, s, 2)
    assert not is_causal_cut(cut["attention_mask"], cell)
    assert "attention_mask" in next(CellBatches(iter([cut]), cell, must_drop_mask=False))
    with pytest.raises(ValueError, match="--reset-attention-mask"):
        next(CellBatches(iter([cut]), cell, must_drop_mask=True))


def test_cell_batches_trust_cell_data_on_a_plain_causal_mask(monkeypatch):
    # A cell of a microbatch whose whole mask CellData found plain causal (CausalCut): the mask
    # is dropped without being read again, and the other tensors are still made contiguous
    from megatron_terapipe.megatron.hooks import lm_cells
    from megatron_terapipe.runtime.batching import CausalCut, CellData

    s = 32
    causal = torch.ones(s, s).tril().unsqueeze(0).unsqueeze(0) < 0.5
    tokens = torch.arange(2 * s).view(2, s)
    cell = _cell(8, 16)
    data = CellData(iter([{"tokens": tokens, "attention_mask": causal}]), s, 2)
    cut = next(data.iterator_for(cell))
    assert isinstance(cut, CausalCut)
    monkeypatch.setattr(lm_cells, "is_causal_cut", lambda *a: pytest.fail("mask read again"))
    out = next(lm_cells.CellBatches(iter([cut]), cell, must_drop_mask=True))
    assert type(out) is dict and "attention_mask" not in out and out["tokens"].is_contiguous()


# ---- Megatron-LM's training code not importable ----------------------------------------------
@pytest.mark.parametrize("missing, advice", [
    ("yaml", "pip install pyyaml"),  # 0.18's megatron.training imports it; its wheel lacks it
    ("some_package.sub", "pip install some_package"),
    ("megatron.training", "in a Megatron-LM checkout"),
])
def test_a_megatron_training_that_does_not_import_says_what_to_install(monkeypatch, missing,
                                                                        advice):
    from megatron_terapipe.megatron import launch
    from megatron_terapipe.megatron.hooks import install
    from megatron_terapipe.megatron.platform import compat

    def fails():
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    monkeypatch.setattr(install, "install", lambda: None)
    monkeypatch.setattr(compat, "megatron_lm_argument_hooks", fails)
    with pytest.raises(launch.LauncherError, match=re.escape(advice)) as info:
        launch.install_hooks()
    assert missing in str(info.value)
