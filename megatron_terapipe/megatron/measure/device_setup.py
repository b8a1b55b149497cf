"""What measuring a layer or an edge needs: a device, dtype, parallel state and RNG set up
(CPU mode on CPU), the checks of the common arguments, and timed rounds with progress.
Imports torch and Megatron-Core lazily."""

from __future__ import annotations

import datetime
import platform
import socket
from typing import Optional

import numpy as np

from ...planner.cost.dims import ModelDims
from .progress import Progress

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


def _versions() -> dict:
    import torch

    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # pragma: no cover - source checkouts
        import megatron.core

        mcore = getattr(megatron.core, "__version__", "unknown")
    return {"torch_version": torch.__version__, "megatron_core_version": mcore}


def _ensure_parallel_state() -> None:
    """A one-process gloo group with TP=PP=1 unless the caller set up Megatron already."""
    import torch
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                             rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


class MeasureDevice:
    """Device, dtype, parallel state and RNG set up for a measurement (CPU mode on CPU)."""

    def __init__(self, dtype: str, device: Optional[str], seed: int):
        import torch
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as tp_random

        self.dtype_name = dtype
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                      "float16": torch.float16}.get(dtype)
        if self.dtype is None:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        self.on_gpu = torch.cuda.is_available() if device is None else device.startswith("cuda")
        if not self.on_gpu:
            from ..platform.cpu_mode import enable_cpu_mode

            enable_cpu_mode()
        _ensure_parallel_state()
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        torch.manual_seed(seed)
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.on_gpu
                       else torch.device("cpu"))

    def config(self, model: ModelDims):
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=1, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
            num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn,
            gated_linear_unit=model.gated_linear_unit, tensor_model_parallel_size=self.tp,
            use_cpu_initialization=not self.on_gpu, params_dtype=self.dtype, pipeline_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16,
            hidden_dropout=0.0, attention_dropout=0.0)

    def sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()

    def name(self) -> str:
        import torch

        if self.on_gpu:
            return torch.cuda.get_device_name()
        return platform.processor() or platform.machine() or "cpu"

    def metadata(self, repeats: int, warmup: int, statistic: str, timing: str = "wall") -> dict:
        import torch

        return {"device": self.name(), "device_type": "cuda" if self.on_gpu else "cpu",
                "dtype": self.dtype_name, "tensor_parallel": self.tp, "repeats": repeats,
                "warmup": warmup, "statistic": statistic, "timing": timing,
                "threads": torch.get_num_threads(),
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                **_versions()}


def check_repeats(repeats: int, statistic: str, timing: str = "wall") -> None:
    """The common arguments of a measurement, checked before any work starts."""
    from .clocks import check_timing

    check_timing(timing)
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic must be 'min' or 'median', got {statistic!r}")
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")


def check_position_type(kind: str) -> None:
    if kind not in POSITION_EMBEDDING_TYPES:
        raise ValueError(f"position_embedding_type must be one of "
                         f"{', '.join(POSITION_EMBEDDING_TYPES)}, got {kind!r}")


def timed_rounds(points: list, run, repeats: int, warmup: int, statistic: str, label: str,
                  progress: bool, settle: int = 0) -> np.ndarray:
    """[len(points), outputs] statistic over rounds of run(*point); each round visits every
    point, so a burst of outside load hits one sample of many points, not every sample of one.
    settle: untimed runs of a point right before its timed run in every round."""
    bar = Progress(len(points) * (warmup + repeats), label, enabled=progress)
    samples = None
    for round_ in range(-warmup, repeats):
        for i, point in enumerate(points):
            for _ in range(settle):
                run(*point)
            times = run(*point)
            if samples is None:
                samples = np.zeros((repeats, len(points), len(times)))
            if round_ >= 0:
                samples[round_, i] = times
            bar.step(f"round {round_ + warmup + 1}: " + " ".join(
                f"{k}={v}" for k, v in zip("blc", point)))
    if samples is None:
        return np.zeros((0, 0))
    return samples.min(axis=0) if statistic == "min" else np.median(samples, axis=0)
