"""Named model shapes and GPU node types for the planner.

Model shapes follow Table 1 of the TeraPipe paper (Li et al., ICML 2021) for layers and hidden
size. The paper does not list head counts; we use 128-dimensional heads as the GPT-3 paper
(Brown et al. 2020, Table 2.1) does for 13B and 175B, which gives 16 heads for the 1B model
(the TeraPipe reference code does the same) and 48 heads for the 44B model (our assumption).
Vocabulary: GPT-3 uses GPT-2's byte-level BPE of 50257 tokens (GPT-3 paper, section 2.1). The
presets keep that size; a Megatron run pads it to a multiple of 128 x TP (50304 at TP=1, 51200
at TP=8), under 2% more output-layer work: replace(preset, vocab_size=...) to count it.

Hardware figures are vendor datasheet peaks (dense fp16/bf16 tensor-core FLOP/s, HBM bandwidth)
and public instance specifications. The rest of each preset (GEMM efficiency and its ramp with
a cell's rows, the fixed cost per layer pass, the K/V prefix's cost per earlier slice, the links'
effective bandwidth and latency, the share of the data-parallel reduction not overlapped) is
fitted to published runs and this project's own GPU measurements by benchmarks/fit_presets.py,
which writes fitted_presets.json beside this file: the parameters, what they were fitted on and
each fitted row's error (`preset_fit`, `trust_line`). A preset without a fit keeps assumed
figures and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from .dims import Hardware, Link, ModelDims

GiB = 1024 ** 3
GPT2_VOCAB = 50257  # GPT-2 BPE, which GPT-3 reuses


def _gpt3(name: str, num_layers: int, hidden_size: int, num_attention_heads: int) -> ModelDims:
    return ModelDims(num_layers=num_layers, hidden_size=hidden_size,
                     num_attention_heads=num_attention_heads, name=name, vocab_size=GPT2_VOCAB)


MODEL_PRESETS: dict[str, ModelDims] = {
    # TeraPipe Table 1: GPT3-1B, 24 layers, hidden 2048 (GPT-3 paper's "XL", 1.3B parameters).
    "gpt3-1b": _gpt3("gpt3-1b", 24, 2048, 16),
    # TeraPipe Table 1: GPT3-13B, 40 layers, hidden 5120; GPT-3 paper: 40 heads of 128.
    "gpt3-13b": _gpt3("gpt3-13b", 40, 5120, 40),
    # TeraPipe Table 1: GPT3-44B, 96 layers, hidden 6144; 48 heads of 128 is our assumption.
    "gpt3-44b": _gpt3("gpt3-44b", 96, 6144, 48),
    # TeraPipe Table 1 / GPT-3 paper: 175B, 96 layers, hidden 12288, 96 heads of 128.
    "gpt3-175b": _gpt3("gpt3-175b", 96, 12288, 96),
}

# Datasheet rows, in Hardware's field order: name, peak FLOP/s, HBM bytes/s, HBM GiB, GPUs per
# node, intra-node link (bytes/s, s), inter-node link (bytes/s, s), GPUs sharing that link.
#
# v100: AWS p3.16xlarge, the TeraPipe paper's machine: 8x V100-SXM2 16 GB.
#   125 TFLOP/s fp16 tensor core and 900 GB/s HBM2 (NVIDIA V100 datasheet).
#   NVLink 2.0 hybrid cube mesh: 25 GB/s per link per direction, neighbours share 1-2 links.
#   25 Gbit/s Ethernet between instances (AWS instance specification), shared by the node.
# a100: DGX A100 80 GB: 312 TFLOP/s bf16 dense, 2039 GB/s HBM2e (A100 datasheet); NVLink 3
#   through NVSwitch, 600 GB/s per GPU both directions; 8x 200 Gbit/s HDR InfiniBand, one per GPU.
# h100: DGX H100: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3 (H100 SXM datasheet); NVLink 4 through
#   NVSwitch, 900 GB/s per GPU both directions; 8x 400 Gbit/s NDR InfiniBand, one per GPU.
_DATASHEETS = {
    "v100": ("v100 (p3.16xlarge)", 125e12, 900e9, 16, 8, (50e9, 10e-6), (25e9 / 8, 50e-6), 8),
    "a100": ("a100 (DGX A100 80GB)", 312e12, 2039e9, 80, 8, (300e9, 8e-6), (200e9 / 8, 15e-6), 1),
    "h100": ("h100 (DGX H100)", 989e12, 3350e9, 80, 8, (450e9, 8e-6), (400e9 / 8, 15e-6), 1),
}
#: What a preset without a fit assumes beyond its datasheet.
ASSUMED = {"matmul_efficiency": 0.6, "gemm_half_rows": 256.0, "layer_overhead": 20e-6,
           "prefix_slice_overhead": 0.0, "dp_exposed": 1.0}
#: Written by benchmarks/fit_presets.py.
FITTED_PRESETS_FILE = Path(__file__).with_name("fitted_presets.json")


@dataclass(frozen=True)
class PresetFit:
    """What a preset's parameters were fitted on, and how well they predict those runs."""

    preset: str
    parameters: dict  # Hardware fields; links as [bandwidth bytes/s, latency s]
    fitted_on: str  # e.g. "4 published TeraPipe rows and its 175B slice ablation"
    error: float  # the largest |predicted / measured - 1| over them
    measure: str  # what was compared, e.g. "iteration time"


def datasheet(key: str) -> Hardware:
    """The preset's datasheet figures with the assumed efficiencies (no fit)."""
    name, peak, bandwidth, memory_gib, gpus_per_node, intra, inter, per_nic = _DATASHEETS[key]
    return Hardware(name=name, peak_flops=peak, memory_bandwidth=bandwidth,
                    memory_bytes=memory_gib * GiB, gpus_per_node=gpus_per_node,
                    intra_node=Link(*intra), inter_node=Link(*inter), gpus_per_nic=per_nic,
                    **ASSUMED)


def with_parameters(hardware: Hardware, parameters: dict) -> Hardware:
    """`hardware` with fitted `parameters` (links given as [bandwidth, latency])."""
    values = {k: (Link(*v) if k in ("intra_node", "inter_node") else float(v))
              for k, v in parameters.items()}
    return replace(hardware, **values)


def _load_fits() -> dict[str, PresetFit]:
    if not FITTED_PRESETS_FILE.is_file():
        return {}
    data = json.loads(FITTED_PRESETS_FILE.read_text())
    return {key: PresetFit(key, fit["parameters"], fit["fitted_on"], float(fit["error"]),
                           fit["measure"]) for key, fit in data.get("presets", {}).items()}


PRESET_FITS: dict[str, PresetFit] = _load_fits()
HARDWARE_PRESETS: dict[str, Hardware] = {
    key: with_parameters(datasheet(key), PRESET_FITS[key].parameters) if key in PRESET_FITS
    else datasheet(key) for key in _DATASHEETS}


def preset_fit(name: str) -> Optional[PresetFit]:
    return PRESET_FITS.get(name.lower())


def trust_line(name: str) -> str:
    """One line on how far the preset's predictions can be trusted."""
    fit = preset_fit(name)
    if fit is None:
        return (f"{name} preset: not fitted to any measurement (datasheet figures, assumed "
                f"efficiencies): measure a profile (--profile) for planning that matters")
    return (f"{name} preset: fitted on {fit.fitted_on}; {fit.measure} within "
            f"{fit.error * 100:.0f}%")


def _lookup(presets: dict, kind: str, name: str):
    try:
        return presets[name.lower()]
    except KeyError:
        raise ValueError(f"unknown {kind} preset {name!r}; choose one of "
                         f"{', '.join(sorted(presets))}") from None


def model_preset(name: str) -> ModelDims:
    return _lookup(MODEL_PRESETS, "model", name)


def hardware_preset(name: str) -> Hardware:
    return _lookup(HARDWARE_PRESETS, "hardware", name)
