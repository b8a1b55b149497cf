"""Measuring a real Megatron layer on token slices (CPU, tiny model) and planning with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from harness.paths import ROOT
from megatron_terapipe.planner import Link, ProfiledCostModel, solve_slicing
from megatron_terapipe.planner.profile.least_squares import non_decreasing


def test_measure_fit_save_and_plan(tmp_path):
    out = tmp_path / "profile.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "megatron_terapipe.megatron.measure", "layers",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
         "--batch-sizes", "1,2", "--granularity", "16", "--points", "4", "--dtype", "float32",
         "--repeats", "2", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "measuring layer" in proc.stderr  # progress goes to stderr
    # stderr is a pipe, not a terminal: a few plain lines, not one redrawn line per cell
    progress = [line for line in proc.stderr.splitlines() if line.startswith("measuring layer")]
    assert 1 <= len(progress) <= 4 and progress[-1].endswith("(100%)") and "\r" not in proc.stderr
    assert "held-out error" in proc.stdout
    assert "deferred weight gradients at 2x128 tokens: backward" in proc.stdout
    data = json.loads(out.read_text())
    meta = data["metadata"]
    assert meta["device_type"] == "cpu" and meta["dtype"] == "float32"
    assert meta["model"]["hidden_size"] == 64 and meta["tensor_parallel"] == 1
    assert meta["torch_version"] and meta["megatron_core_version"]
    times = data["measurements"]["forward"] + data["measurements"]["backward"]
    assert all(t > 0 for t in times)
    assert sorted(set(data["measurements"]["context"]))[0] == 0 and max(data["measurements"]["context"]) > 0
    # context-free cells also ran with deferred weight gradients: the backward without them and
    # the W action computing them, with every parameter deferring: the four linear layers' (QKV,
    # projection, FC1, FC2) weights and biases, the two norms' weights and biases
    assert meta["wgrad_deferring_parameters"] == 12
    m = data["measurements"]
    for c, w, bd in zip(m["context"], m["wgrad"], m["deferred_backward"]):
        assert (w is None and bd is None) if c else (w > 0 and bd > 0)
    cost = ProfiledCostModel.load(out, layers_per_stage=2, link=Link(10e9, 1e-5))
    assert cost.fit.has_wgrad
    b, l = max((b, l) for b, l, c in zip(m["batch"], m["length"], m["context"]) if c == 0)
    # W is charged as measured, whatever the context: the per-length table of the measured W
    # times made non-decreasing (isotonic regression, checked against brute force in
    # test_cost_model_profiled.py), not their running maximum, which equals it only where noise
    # leaves the measurements in order (a clean-clone CI run on a noisy machine failed on that)
    lengths = sorted({ll for bb, ll, c in zip(m["batch"], m["length"], m["context"])
                      if bb == b and c == 0})
    samples = [[w for bb, ll, c, w in zip(m["batch"], m["length"], m["context"], m["wgrad"])
                if bb == b and ll == length and c == 0] for length in lengths]
    table = non_decreasing(np.array([np.median(x) for x in samples]),
                           np.array([len(x) for x in samples]))
    assert cost.layer_wgrad_time(b, l, 64) == pytest.approx(table[lengths.index(l)], rel=1e-12)
    assert cost.layer_wgrad_time(b, l, 64) == cost.layer_wgrad_time(b, l, 0)
    assert min(min(x) for x in samples) <= table[-1] <= max(max(x) for x in samples)
    solution = solve_slicing(cost, 128, 2, 4, granularity=16)
    assert solution.plan.seq_length == 128
