"""The version-sensitive part of `--terapipe-cpu`'s checkpoint touch point, Megatron-LM's
`megatron.training.checkpointing`, checked as compat.py checks the others: `compat.require_tested`
first, `compat.moved` where the module is not as the tested lines have it (Megatron-LM
core_v0.16.1 and core_v0.19.0). docs/compatibility.md lists it with the other touch points.
"""

from __future__ import annotations

import importlib
import types

from . import compat

CHECKPOINTING_MODULE = "megatron.training.checkpointing"


def megatron_lm_checkpointing() -> types.ModuleType:
    """megatron.training.checkpointing, checked for the two module-level names --terapipe-cpu
    replaces for it: `torch` (it saves and restores the CUDA RNG state and agrees on the
    loaded iteration with a device="cuda" tensor) and `tensor_parallel` (it reads the RNG
    tracker's states through it, and refuses to load empty ones)."""
    compat.require_tested("Megatron-LM checkpoints on CPU (--terapipe-cpu)")
    module = importlib.import_module(CHECKPOINTING_MODULE)
    if getattr(module, "torch", None) is None:
        raise compat.moved("Megatron-LM checkpoints on CPU",
                           f"{CHECKPOINTING_MODULE} no longer imports torch at module level")
    tensor_parallel = getattr(module, "tensor_parallel", None)
    if not callable(getattr(tensor_parallel, "get_cuda_rng_tracker", None)):
        raise compat.moved("Megatron-LM checkpoints on CPU",
                           f"{CHECKPOINTING_MODULE} reads the RNG tracker elsewhere than "
                           "through a module-level tensor_parallel")
    return module
