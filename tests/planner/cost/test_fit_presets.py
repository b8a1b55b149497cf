"""benchmarks/fit_presets.py recovers planted physical parameters, and terapipe-plan's trust
line says what a preset was fitted on and its error there, from the fit's own output file."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import fit_presets
import preset_targets
from megatron_terapipe.planner.cost import presets
from megatron_terapipe.planner.cost.presets import datasheet, trust_line

STAGE = {"num_layers": 4, "num_attention_heads": 32, "seq_length": 2048, "micro_batch_size": 1,
         "vocab_size": 1024}
PLANTED = {"matmul_efficiency": 0.45, "gemm_half_rows": 300.0, "layer_overhead": 5e-5}
PARAMS = [fit_presets.Parameter("matmul_efficiency", 0.7, 0.05, 1.0),
          fit_presets.Parameter("gemm_half_rows", 60.0, 1.0, 1e5),
          fit_presets.Parameter("layer_overhead", 1e-6, 1e-8, 1e-2)]


def synthetic_targets(hardware) -> list:
    """Stage times a planted preset gives, for two widths and six slice counts."""
    targets = []
    for hidden in (2048, 4096):
        args = dict(STAGE, hidden_size=hidden)
        for slices in (1, 2, 4, 8, 16, 32):
            measured = preset_targets.stage_busy(hardware, args, slices)
            targets.append(preset_targets.Target(
                f"h{hidden} x{slices}", measured,
                lambda hw, a=args, n=slices: preset_targets.stage_busy(hw, a, n), "s"))
    return targets


def test_the_fit_recovers_planted_parameters():
    base = datasheet("h100")
    planted = replace(base, **PLANTED)
    fitted = fit_presets.fit_preset(base, PARAMS, synthetic_targets(planted), iterations=40,
                                    progress=lambda line: None)
    for name, value in PLANTED.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.02), name


def test_the_fit_fails_where_the_targets_disagree_with_the_model():
    """A planted fault: measured times that no parameters reproduce (one doubled) stay off."""
    planted = replace(datasheet("h100"), **PLANTED)
    targets = synthetic_targets(planted)
    targets[3] = replace(targets[3], measured=2 * targets[3].measured)
    fitted = fit_presets.fit_preset(datasheet("h100"), PARAMS, targets, iterations=40,
                                    progress=lambda line: None)
    errors = [t.predict(fitted) / t.measured - 1 for t in targets]
    assert max(abs(e) for e in errors) > 0.1


def test_levenberg_marquardt_stays_in_bounds():
    z = fit_presets.levenberg_marquardt(lambda z: np.array([z[0] - 5.0]), np.array([0.0]),
                                        np.array([-1.0]), np.array([1.0]),
                                        progress=lambda line: None)
    assert z[0] == pytest.approx(1.0)


def test_the_trust_line_quotes_the_fit_file(tmp_path, monkeypatch):
    fits = {"v100": presets.PresetFit("v100", {}, "4 published rows", 0.123, "iteration time")}
    monkeypatch.setattr(presets, "PRESET_FITS", fits)
    assert trust_line("v100") == "v100 preset: fitted on 4 published rows; iteration time within 12%"
    assert trust_line("a100").startswith("a100 preset: not fitted to any measurement")


def test_the_committed_fit_is_what_the_presets_use():
    data = json.loads(presets.FITTED_PRESETS_FILE.read_text())
    for key, fit in data["presets"].items():
        assert presets.preset_fit(key).error == fit["error"]
        assert fit["error"] == max(abs(t["error"]) for t in fit["targets"])
        hardware = presets.HARDWARE_PRESETS[key]
        assert hardware.matmul_efficiency == fit["parameters"]["matmul_efficiency"]
        assert trust_line(key).endswith(f"within {fit['error'] * 100:.0f}%")
