"""Measuring the pipeline's edges (embedding; output layer and loss) with Megatron on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from harness.paths import ROOT
from megatron_terapipe.planner import Link, ModelDims, ProfiledCostModel

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)

# In a child process: measuring turns on CPU mode and a process group, process-wide.
SNIPPET = """
import json, sys
from megatron_terapipe.megatron.measure.edges import measure_edge_times
from megatron_terapipe.planner import ModelDims, fit_edge_times
model = ModelDims(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=512)
m = measure_edge_times(model, [(1, 32), (1, 512), (2, 1024)], dtype="float32", repeats=3,
                       progress=False)
fit = fit_edge_times(m)
json.dump({"measurements": m.to_dict(), "metadata": m.metadata, "coef": fit.coef}, sys.stdout)
"""


def test_measured_edges_are_positive_and_grow_with_the_tokens():
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", SNIPPET], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    m, meta = out["measurements"], out["metadata"]
    assert meta["vocab_size"] == 512 and meta["position_embedding_type"] == "learned_absolute"
    assert meta["device_type"] == "cpu" and meta["max_sequence_length"] == 1024
    for key in ("embedding_forward", "embedding_backward", "output_forward", "output_backward"):
        times = np.array(m[key])
        assert np.all(times > 0), key
        assert times[-1] > times[0], (key, times)  # 2048 tokens against 32
        a, slope = out["coef"][key]
        assert slope > 0 and a >= 0, (key, a, slope)


def test_measure_cli_with_vocab_size_writes_edges(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "megatron_terapipe.megatron.measure", "layers",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
         "--granularity", "16", "--points", "3", "--dtype", "float32", "--repeats", "1",
         "--vocab-size", "128", "--position-embedding-type", "rope", "--out", str(out)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "measuring edges" in proc.stderr and "edges at" in proc.stdout
    data = json.loads(out.read_text())
    assert data["edges"]["metadata"]["position_embedding_type"] == "rope"
    assert data["metadata"]["model"]["vocab_size"] == 128
    cost = ProfiledCostModel.load(out, layers_per_stage=1, link=Link(10e9, 1e-5),
                                  model=ModelDims(num_layers=2, hidden_size=32, num_attention_heads=4,
                                                  vocab_size=128))
    assert cost.edge_forward_time(1, 64, True, True) > 0
    assert cost.edge_backward_time(1, 64, False, True) > 0
