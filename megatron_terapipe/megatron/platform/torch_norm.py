"""TorchNorm: Megatron's torch LayerNorm / RMSNorm that also runs sequence-parallel.

Kept on the platform floor because both the layer specs (model/layer_specs.py) and CPU mode for
Megatron-LM's script (lm_cpu.py) build it.
"""

from __future__ import annotations

import torch


class TorchNorm:
    """Megatron's torch LayerNorm/RMSNorm, also under sequence parallelism.

    Megatron's local norm refuses sequence parallelism because only TE/apex norms mark their
    parameters for the tensor-parallel all-reduce of their gradients. This one marks them, so
    the local spec runs sequence-parallel wherever the collectives exist (gloo included). Being
    torch's own LayerNorm / RMSNorm, it defers its weight and bias gradients to the W actions
    (runtime/wgrad/norm.py, hooked with the linear layers by install_wgrad_deferral).
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"TorchNorm supports LayerNorm and RMSNorm, not {config.normalization}")
        for param in norm.parameters():
            setattr(param, "sequence_parallel", bool(config.sequence_parallel))
        return norm
