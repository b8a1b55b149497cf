"""The README's commands: the training example and the API quick start run end to end."""

import os
import re
import subprocess
import sys

from harness.machine_lock import one_run_at_a_time
from harness.paths import ROOT


def _run(args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    with one_run_at_a_time():  # both examples start 2 processes
        return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)


def test_training_example_runs_terapipe_and_loss_falls(tmp_path):
    trace = tmp_path / "trace.json"
    out = _run([sys.executable, "examples/pretrain_gpt_terapipe.py", "--train-iters", "8",
                "--seq-length", "512", "--micro-batch-size", "2", "--num-microbatches", "2",
                "--terapipe-num-slices", "4", "--terapipe-cache-dir", str(tmp_path),
                "--eval-interval", "4", "--terapipe-trace", str(trace), "--compare-iters", "1"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "schedule: forward_backward_terapipe" in out.stdout
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out.stdout)]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 0.5
    assert "validation loss at iteration 8" in out.stdout
    # the side-by-side timing against Megatron's own 1F1B, in plain lines (not a terminal)
    assert re.search(r"> +TeraPipe \(4 token slices\) \.+ [0-9.]+ ms per iteration", out.stdout)
    assert re.search(r"> +Megatron 1F1B \.+ [0-9.]+ ms per iteration", out.stdout)
    assert re.search(r"> +speedup \.+ [0-9.]+x", out.stdout)
    assert "\033[" not in out.stdout and "\r" not in out.stdout
    import json

    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    cells = [e for e in spans if e["cat"] in ("forward", "backward")]
    # 2 stages x (forward + backward) x 4 token slices x 2 microbatches
    assert len(cells) == 2 * 2 * 4 * 2
    # plus, if the planner deferred weight gradients, one W per stage and microbatch
    assert len(spans) - len(cells) in (0, 2 * 2)
    assert {e["pid"] for e in spans} == {0, 1}
    # the simulator's trace of the same plan, to open beside it
    simulated = json.loads((tmp_path / "trace.simulated.json").read_text())["traceEvents"]
    assert len([e for e in simulated if e.get("ph") == "X"]) == len(spans)


def test_training_example_rejects_bad_flags_before_starting():
    out = _run([sys.executable, "examples/pretrain_gpt_terapipe.py", "--terapipe-slices", "100", "100"])
    assert out.returncode == 2
    assert "--terapipe-slices" in out.stderr and "sum to 200 tokens" in out.stderr
    assert "launching" not in out.stdout


def test_quickstart_runs():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "examples/quickstart.py"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"summed token loss per microbatch: \[([0-9.]+, ){3}[0-9.]+\]", out.stdout)
