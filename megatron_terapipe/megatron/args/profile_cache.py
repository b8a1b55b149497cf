"""Measured layer profiles for --terapipe-cost-model profile: which cells to measure, how, and
where the fitted profile is cached on disk (keyed by everything the measurement depends on)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from ...planner.profile.time_fit import LayerTimeFit
from ...planner.profile.time_fitting import fit_layer_times
from ...planner.profile.time_samples import LayerMeasurements, default_grid
from .model_shape import device_name, model_dims_from_args
from .flags import DEFAULT_PROFILE_POINTS, dtype_name, granularity, slice_unit, tp_size


def cache_dir(args) -> Path:
    explicit = getattr(args, "terapipe_cache_dir", None)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_terapipe"


def profile_points(args) -> int:
    return int(getattr(args, "terapipe_profile_points", DEFAULT_PROFILE_POINTS))


def profile_cache_key(args, seq_length: int, micro_batch_size: int) -> dict:
    """What a measured profile depends on: model shape, parallelism, grid, device, versions."""
    import torch

    try:
        from megatron.core import __version__ as mcore_version
    except Exception:  # pragma: no cover
        mcore_version = "unknown"
    from ...version import __version__

    return {
        "model": model_dims_from_args(args).to_dict() | {"num_layers": None},
        "tensor_parallel": tp_size(args),
        "sequence_parallel": bool(getattr(args, "sequence_parallel", False)),
        "dtype": dtype_name(args),
        "seq_length": int(seq_length),
        "micro_batch_size": int(micro_batch_size),
        "granularity": granularity(args),
        "points": profile_points(args),
        "device": device_name(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "megatron.core": mcore_version, "megatron_terapipe": __version__,
                     "python": platform.python_version()},
    }


def profile_cache_path(args, seq_length: int, micro_batch_size: int) -> Path:
    key = profile_cache_key(args, seq_length, micro_batch_size)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(args) / f"layer-profile-{digest}.json"


def is_cached(path: Path) -> bool:
    """Whether `path` holds a profile in this version's format. An entry in an older format is
    measured again and overwritten, as an unreadable one."""
    if not path.is_file():
        return False
    try:
        return LayerTimeFit.load(path).is_current_format
    except ValueError:
        return False


def save_profile(fit: LayerTimeFit, path: Path) -> None:
    """Write `fit` to `path` whole or not at all (other processes may read the cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fit.save(tmp)
    os.replace(tmp, path)


def profile_cells(args, seq_length: int, micro_batch_size: int) -> list[tuple[int, int, int]]:
    """The (batch, length, context) cells to measure: a small grid over the run's shapes."""
    sizes = sorted({b for b in (1, micro_batch_size) if micro_batch_size % b == 0})
    return default_grid(seq_length, sizes, granularity=slice_unit(args), points=profile_points(args))


def default_measure(args, cells: list[tuple[int, int, int]], progress: bool = True
                    ) -> LayerMeasurements:
    """Measure one layer of this model on this device (every rank runs it; see
    ArgsPlanProvider): Megatron's GPT layer with slice-aware attention on real token slices,
    tensor-parallel as the run is."""
    from ..measure.layers import measure_layer_times

    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(dtype_name(args), "float32")
    return measure_layer_times(model_dims_from_args(args), cells, dtype=dtype,
                               repeats=2, warmup=1, progress=progress,
                               position_embedding_type=getattr(args, "position_embedding_type",
                                                               None) or "learned_absolute")


def fit_measurements(args, measurements: LayerMeasurements, seq_length: int,
                     micro_batch_size: int) -> LayerTimeFit:
    measurements.metadata.setdefault("model", model_dims_from_args(args).to_dict())
    measurements.metadata.setdefault("tensor_parallel", tp_size(args))
    measurements.metadata.setdefault("device", device_name())
    measurements.metadata.setdefault("dtype", dtype_name(args))
    measurements.metadata["cache_key"] = profile_cache_key(args, seq_length, micro_batch_size)
    return fit_layer_times(measurements)
