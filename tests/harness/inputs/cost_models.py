"""Cost models and measurements the planner's tests build: analytic models of the presets, and
synthetic measurements whose true form is known (layer times of the paper's form, memory of
known bytes per feature), so that a fit can be held to it exactly."""

from __future__ import annotations

import numpy as np

from megatron_terapipe.planner import (AnalyticCostModel, Link, ModelDims, hardware_preset,
                                       model_preset)
from megatron_terapipe.planner.profile.memory_fit import (MemoryMeasurements, cell_features,
                                                          hold_features, whole_features)
from megatron_terapipe.planner.profile.time_samples import LayerMeasurements, default_grid


def analytic(model="gpt3-1b", hardware="v100", layers=1, **kw):
    return AnalyticCostModel(model_preset(model), hardware_preset(hardware), layers, **kw)


GPT13 = model_preset("gpt3-13b")
H100 = hardware_preset("h100")


def gpt3_13b_h100(tp: int, sp: bool = False) -> AnalyticCostModel:
    """gpt3-13b on H100s, 5 layers a stage, TP `tp` with the stages across nodes, sequence
    parallelism if `sp`."""
    return analytic("gpt3-13b", "h100", 5, tensor_parallel=tp, inter_node=True,
                    sequence_parallel=sp)


# ---- layer times of a known form -------------------------------------------------------------

MODEL = ModelDims(num_layers=4, hidden_size=256, num_attention_heads=4, name="tiny")
LINK = Link(bandwidth=10e9, latency=1e-5)


def paper_form(b, l, c):
    """A layer whose time has exactly the fitted form: base table plus bilinear context term."""
    base = 1e-4 + b * (2e-6 * l + 1e-9 * l * l)
    extra = np.where(c > 0, 5e-5 + 1e-7 * l + 3e-8 * c + 2e-10 * l * c, 0.0)
    return base + b * extra


def synthetic(noise=0.0, seed=0, batches=(1, 2, 4)):
    cells = np.array(default_grid(1024, batches, granularity=16, points=7), dtype=float)
    b, l, c = cells.T
    rng = np.random.default_rng(seed)
    fwd = paper_form(b, l, c) * (1 + noise * rng.standard_normal(len(b)))
    bwd = 2 * paper_form(b, l, c) * (1 + noise * rng.standard_normal(len(b)))
    meta = {"device": "synthetic", "dtype": "float32", "model": MODEL.to_dict(),
            "tensor_parallel": 1, "torch_version": "n/a", "megatron_core_version": "n/a"}
    return LayerMeasurements(b, l, c, fwd, bwd, meta)


# ---- memory of known bytes -------------------------------------------------------------------

TRUE_BYTES = {  # bytes per feature, per part
    "cell": {"layer": [3616, 0, 256, 0, 0], "shared": [0, 0, 0, 4, 0],
             "embedding": [8, 0, 0, 0, 0], "output": [1045, 0, 0, 0, 64]},
    "hold": {"layer": [4096, 0], "shared": [0, 0], "embedding": [0, 0], "output": [768, 0]},
    "whole": {"layer": [4640, 3.0, 256, 0], "shared": [0, 0, 0, 0],
              "embedding": [8, 0, 0, 0], "output": [1045, 0, 0, 64]},
}
KINDS = {"layers1": (1, False, False), "layers2": (2, False, False),
         "first1": (1, True, False), "last1": (1, False, True)}


def true_bytes(table, features, point, layers, first, last):
    f = np.array(features(*point))
    total = layers * f @ table["layer"] + f @ table["shared"]
    return float(total + first * (f @ table["embedding"]) + last * (f @ table["output"]))


def synthetic_measurements() -> MemoryMeasurements:
    cells = [(r, t, c) for r in (1, 2) for t in (32, 64) for c in (0, 32, 96)]
    wholes = [(r, t) for r in (1, 2) for t in (64, 128, 256)]
    m = MemoryMeasurements({}, {}, {}, kv_bytes_per_token=512.0, freed_before_kv_grad=0.7,
                           freed_before_kv_grad_deferred=0.4, metadata={"model": {"hidden_size": 64}})
    for kind, (L, first, last) in KINDS.items():
        m.cells[kind] = [(*p, true_bytes(TRUE_BYTES["cell"], cell_features, p, L, first, last))
                         for p in cells]
        m.holds[kind] = [(r, t, true_bytes(TRUE_BYTES["hold"], hold_features, (r, t), L, first,
                                           last))
                         for r, t in {(r, t) for r, t, _ in cells}]
        m.wholes[kind] = [(*p, true_bytes(TRUE_BYTES["whole"], whole_features, p, L, first, last))
                          for p in wholes]
    return m
