"""Named model shapes and GPU node types for the planner.

Model shapes follow Table 1 of the TeraPipe paper (Li et al., ICML 2021) for layers and hidden
size. The paper does not list head counts; we use 128-dimensional heads as the GPT-3 paper
(Brown et al. 2020, Table 2.1) does for 13B and 175B, which gives 16 heads for the 1B model
(the TeraPipe reference code does the same) and 48 heads for the 44B model (our assumption).
Vocabulary: GPT-3 uses GPT-2's byte-level BPE of 50257 tokens (GPT-3 paper, section 2.1). The
presets keep that size; a Megatron run pads it to a multiple of 128 x TP (50304 at TP=1, 51200
at TP=8), under 2% more output-layer work: replace(preset, vocab_size=...) to count it.

Hardware figures are vendor datasheet peaks (dense fp16/bf16 tensor-core FLOP/s, HBM bandwidth)
and public instance specifications. The efficiency figures (`matmul_efficiency`,
`saturation_tokens`, `layer_overhead`) are modelling assumptions, not measurements: replace them
with a ProfiledCostModel measured on your own GPUs for planning that matters.
"""

from __future__ import annotations

from .dims import Hardware, Link, ModelDims

GiB = 1024 ** 3
GPT2_VOCAB = 50257  # GPT-2 BPE, which GPT-3 reuses

MODEL_PRESETS: dict[str, ModelDims] = {
    # TeraPipe Table 1: GPT3-1B, 24 layers, hidden 2048 (GPT-3 paper's "XL", 1.3B parameters).
    "gpt3-1b": ModelDims(num_layers=24, hidden_size=2048, num_attention_heads=16,
                         name="gpt3-1b", vocab_size=GPT2_VOCAB),
    # TeraPipe Table 1: GPT3-13B, 40 layers, hidden 5120; GPT-3 paper: 40 heads of 128.
    "gpt3-13b": ModelDims(num_layers=40, hidden_size=5120, num_attention_heads=40,
                          name="gpt3-13b", vocab_size=GPT2_VOCAB),
    # TeraPipe Table 1: GPT3-44B, 96 layers, hidden 6144; 48 heads of 128 is our assumption.
    "gpt3-44b": ModelDims(num_layers=96, hidden_size=6144, num_attention_heads=48,
                          name="gpt3-44b", vocab_size=GPT2_VOCAB),
    # TeraPipe Table 1 / GPT-3 paper: 175B, 96 layers, hidden 12288, 96 heads of 128.
    "gpt3-175b": ModelDims(num_layers=96, hidden_size=12288, num_attention_heads=96,
                           name="gpt3-175b", vocab_size=GPT2_VOCAB),
}

HARDWARE_PRESETS: dict[str, Hardware] = {
    # AWS p3.16xlarge, the TeraPipe paper's machine: 8x V100-SXM2 16 GB.
    # 125 TFLOP/s fp16 tensor core and 900 GB/s HBM2 (NVIDIA V100 datasheet).
    # NVLink 2.0 hybrid cube mesh: 25 GB/s per link per direction, neighbours share 1-2 links.
    # 25 Gbit/s Ethernet between instances (AWS instance specification), shared by the node.
    # saturation_tokens=256: the paper reports one token costing about as much as 256 on a
    # GPT3-1B layer, which this ramp reproduces.
    "v100": Hardware(
        name="v100 (p3.16xlarge)", peak_flops=125e12, memory_bandwidth=900e9,
        memory_bytes=16 * GiB, gpus_per_node=8,
        intra_node=Link(bandwidth=50e9, latency=10e-6),
        inter_node=Link(bandwidth=25e9 / 8, latency=50e-6),
        matmul_efficiency=0.6, saturation_tokens=256, layer_overhead=30e-6,
    ),
    # DGX A100 80 GB: 312 TFLOP/s bf16 dense, 2039 GB/s HBM2e (A100 datasheet); NVLink 3 through
    # NVSwitch, 600 GB/s per GPU both directions; 8x 200 Gbit/s HDR InfiniBand, one per GPU.
    "a100": Hardware(
        name="a100 (DGX A100 80GB)", peak_flops=312e12, memory_bandwidth=2039e9,
        memory_bytes=80 * GiB, gpus_per_node=8,
        intra_node=Link(bandwidth=300e9, latency=8e-6),
        inter_node=Link(bandwidth=200e9 / 8, latency=15e-6),
        matmul_efficiency=0.7, saturation_tokens=512, layer_overhead=20e-6,
    ),
    # DGX H100: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3 (H100 SXM datasheet); NVLink 4 through
    # NVSwitch, 900 GB/s per GPU both directions; 8x 400 Gbit/s NDR InfiniBand, one per GPU.
    "h100": Hardware(
        name="h100 (DGX H100)", peak_flops=989e12, memory_bandwidth=3350e9,
        memory_bytes=80 * GiB, gpus_per_node=8,
        intra_node=Link(bandwidth=450e9, latency=8e-6),
        inter_node=Link(bandwidth=400e9 / 8, latency=15e-6),
        matmul_efficiency=0.6, saturation_tokens=1024, layer_overhead=15e-6,
    ),
}


def model_preset(name: str) -> ModelDims:
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of "
                         f"{', '.join(sorted(MODEL_PRESETS))}") from None


def hardware_preset(name: str) -> Hardware:
    try:
        return HARDWARE_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; choose one of "
                         f"{', '.join(sorted(HARDWARE_PRESETS))}") from None
