"""Running Megatron-LM's own `pretrain_gpt.py` through the launcher on CPU, and reading its log.

Needs a Megatron-LM checkout (`MEGATRON_LM_PATH`, the tag matching the installed megatron-core)
and what its training modules import (`triton`, `pybind11`). Every run uses mock data, a small
fp32 GPT and `--terapipe-cpu`; the caller adds the configuration's flags and the schedule.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .machine_lock import one_run_at_a_time
from .paths import ROOT

#: The Megatron-LM checkout the runs use (MEGATRON_LM_PATH; None: the tests skip).
CHECKOUT = os.environ.get("MEGATRON_LM_PATH")


def needs_checkout(*more) -> list:
    """The marks of a test module that runs Megatron-LM's pretrain_gpt.py: `slow`, skipped
    without a checkout or without triton; then `more`."""
    import pytest  # here, not at the top: benchmarks import this module without pytest

    return [
        pytest.mark.slow,
        pytest.mark.skipif(not CHECKOUT, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout "
                           "to run its pretrain_gpt.py"),
        pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                           reason="Megatron-LM's training modules import triton: pip install triton"),
        *more,
    ]

MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
         "--log-interval", "1", "--eval-iters", "1",
         "--attention-dropout", "0", "--hidden-dropout", "0",
         "--pipeline-model-parallel-size", "2", "--terapipe-cpu"]

ITERATION = re.compile(r"iteration\s+(\d+)/.*lm loss: ([0-9.E+-]+).*grad norm: ([0-9.]+)")
VALIDATION = re.compile(r"validation loss at iteration \d+ on validation set \| lm loss value: "
                        r"([0-9.E+-]+)")
STARTED = re.compile(r"iteration\s+1/")
#: The MoE losses an iteration line carries (Megatron's tracker, averaged over the MoE layers).
MOE_LOSS = re.compile(r" (\w*load_balancing_loss|z_loss): ([0-9.E+-]+) \|")


@dataclass
class Pretrain:
    """One `pretrain_gpt.py` run: the exit code, what it logged and how long it took."""

    returncode: int
    log: str
    seconds: float
    iterations: list[tuple[int, float, float]] = field(default_factory=list)  # (i, loss, norm)
    validation: list[float] = field(default_factory=list)
    moe_losses: list[dict[str, float]] = field(default_factory=list)  # per iteration line

    @property
    def started_training(self) -> bool:
        return bool(STARTED.search(self.log))


def checkout_env(checkout: str) -> dict[str, str]:
    """The environment of a run: the checkout and this project importable, one thread per
    process, and this interpreter's directory first on PATH, so that the dataset helpers
    Megatron-LM compiles at start-up (its Makefile calls `python3` / `python3-config`) are
    built for this Python whatever a `.python-version` in the checkout selects."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    python_path = os.pathsep.join([checkout, ROOT, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=python_path, PATH=path, OMP_NUM_THREADS="1")


def pretrain(checkout: str, nproc: int, flags: list[str], port: int, iterations: int = 3,
             timeout: float = 600) -> Pretrain:
    """Run pretrain_gpt.py on `nproc` CPU processes with MODEL, `flags` and `iterations`
    training iterations (then one validation)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(port), "-m", "megatron_terapipe.megatron.launch",
           os.path.join(checkout, "pretrain_gpt.py"), *MODEL,
           "--train-iters", str(iterations), "--eval-interval", str(iterations), *flags]
    with one_run_at_a_time():
        start = time.perf_counter()
        out = subprocess.run(cmd, cwd=checkout, env=checkout_env(checkout), capture_output=True,
                             text=True, timeout=timeout)
    log = out.stdout + out.stderr
    return Pretrain(out.returncode, log, time.perf_counter() - start,
                    [(int(i), float(loss), float(norm)) for i, loss, norm in ITERATION.findall(log)],
                    [float(v) for v in VALIDATION.findall(log)],
                    [{name: float(v) for name, v in MOE_LOSS.findall(line)}
                     for line in log.splitlines() if ITERATION.search(line)])
