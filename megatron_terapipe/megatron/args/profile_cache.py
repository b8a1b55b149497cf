"""Measured layer profiles for --terapipe-cost-model profile: which cells to measure, how, and
where the fitted profile is cached on disk (keyed by everything the measurement depends on:
the model, the parallelism, the cells, the device and the versions)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from ...planner.profile.time_fit import LayerTimeFit
from ...planner.profile.least_squares import fit_layer_times
from ...planner.profile.time_samples import LayerMeasurements, default_grid
from ..platform.compat import UnsupportedMegatronError
from .settings import RunSettings


def device_name() -> str:
    """The device this process runs on, as the cache key and the log name it."""
    import torch

    if torch.cuda.is_available():
        try:
            return torch.cuda.get_device_name()
        except Exception:  # pragma: no cover
            return "cuda"
    return f"cpu ({platform.machine()}, {platform.processor() or 'unknown'})"


def cache_dir(explicit) -> Path:
    """--terapipe-cache-dir, else $XDG_CACHE_HOME/megatron_terapipe or ~/.cache/megatron_terapipe."""
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_terapipe"


def profile_cache_key(run: RunSettings) -> dict:
    """What a measured profile of `run`'s batch depends on: model shape, parallelism, grid,
    device, versions."""
    import torch

    from ...version import __version__

    shape = run.shape
    return {
        "model": run.require_model().to_dict() | {"num_layers": None},
        "tensor_parallel": shape.tensor_parallel,
        "sequence_parallel": shape.sequence_parallel,
        "dtype": shape.dtype,
        "seq_length": shape.seq_length,
        "micro_batch_size": shape.micro_batch_size,
        "granularity": run.terapipe.granularity,
        "points": run.terapipe.profile_points,
        "device": device_name(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "megatron.core": megatron_core_version(), "megatron_terapipe": __version__,
                     "python": platform.python_version()},
    }


def megatron_core_version() -> str:
    """megatron-core's version string as it names itself (package_info, which checkouts have
    too). Without one the cache cannot tell measurements of different code apart, so there is
    no profile cache: an error, not a key shared under "unknown"."""
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except (ImportError, AttributeError) as exc:
        raise UnsupportedMegatronError(
            f"--terapipe-cost-model profile keys its cache by megatron-core's version, which "
            f"this megatron-core does not give ({exc}): install a released megatron-core or a "
            "checkout with megatron/core/package_info.py, or give --terapipe-cost-model analytic "
            "or a layer-profile file") from exc


def profile_cache_path(run: RunSettings) -> Path:
    key = profile_cache_key(run)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(run.terapipe.cache_dir) / f"layer-profile-{digest}.json"


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


def profile_cells(run: RunSettings) -> list[tuple[int, int, int]]:
    """The (batch, length, context) cells to measure: a small grid over the run's shapes."""
    mbs = run.shape.micro_batch_size
    sizes = sorted({b for b in (1, mbs) if mbs % b == 0})
    return default_grid(run.shape.seq_length, sizes, granularity=run.grid.unit,
                        points=run.terapipe.profile_points)


def default_measure(run: RunSettings, cells: list[tuple[int, int, int]], progress: bool = True
                    ) -> LayerMeasurements:
    """Measure one layer of this model on this device (every rank runs it; see
    ArgsPlanProvider): Megatron's GPT layer with slice-aware attention on real token slices,
    tensor-parallel as the run is."""
    from ..measure.layers import measure_layer_times

    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(run.shape.dtype, "float32")
    return measure_layer_times(run.require_model(), cells, dtype=dtype, repeats=2, warmup=1,
                               progress=progress,
                               position_embedding_type=run.position_embedding_type)


def fit_measurements(run: RunSettings, measurements: LayerMeasurements) -> LayerTimeFit:
    measurements.metadata.setdefault("model", run.require_model().to_dict())
    measurements.metadata.setdefault("tensor_parallel", run.shape.tensor_parallel)
    measurements.metadata.setdefault("device", device_name())
    measurements.metadata.setdefault("dtype", run.shape.dtype)
    measurements.metadata["cache_key"] = profile_cache_key(run)
    return fit_layer_times(measurements)
