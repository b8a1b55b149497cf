"""Megatron-LM's own training script on CPU (`launch ... --terapipe-cpu`), for laptops and CI.

`enable_cpu_mode` covers Megatron-Core. Megatron-LM's `megatron.training` (and Megatron-Core's
rerun state machine, which it drives) assume CUDA in a few more places, each handled here:
- `initialize_megatron` asserts `torch.cuda.is_available()` and sets up model parallelism only
  when `torch.cuda.device_count() > 0`; it then seeds through
  `model_parallel_cuda_manual_seed(seed, te_rng_tracker, inference_rng_tracker, cudagraph_rng)`.
- The legacy fused kernels are compiled with nvcc at start-up, and JIT fusions are warmed up on
  CUDA tensors (nothing on CPU uses either).
- DDP wrapping runs in a side `torch.cuda.Stream`.
- The rerun state machine saves and restores the CUDA RNG state every step.
- Checkpoints (`--save`, `--load`) save and restore the CUDA RNG state, agree on the loaded
  iteration with a device="cuda" tensor, and refuse to load empty RNG tracker states; the CPU
  tracker's are empty (it holds no generators), so checkpoints see them marked
  (`_CheckpointedCpuTracker`).
These modules see a `torch` whose `cuda` answers as one device that is the CPU (streams and
synchronisation are no-ops, the "CUDA" RNG state is the CPU one). Nothing else changes.

Flags the switch sets, because nothing else runs on CPU: `--distributed-backend gloo`,
`--transformer-impl local`, `--no-gradient-accumulation-fusion`, `--no-persist-layer-norm`,
`--no-masked-softmax-fusion`, `--no-bias-gelu-fusion`, `--no-bias-dropout-fusion`. Gradient
clipping (`--clip-grad`, 1.0 by default) runs as on a GPU: `enable_cpu_mode` lets Megatron-Core's
`clip_grad_by_total_norm_fp32` take CPU gradients. `--save`
needs `psutil` (Megatron-Core's torch_dist writer processes import it; without it they die
before reporting and the save waits for them forever), which is checked before training.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import types
import weakref
from typing import Any, Callable

import torch

from . import compat
from . import checkpoint_versions
from .torch_norm import TorchNorm
from .cpu_mode import CpuCudaProxy, NullStream, cpu_torch_proxy, enable_cpu_mode, patch_for_cpu

# The Megatron-LM modules (and the one Megatron-Core module they drive) that see the CPU as
# CUDA differ per line: compat.MEGATRON_LM_CPU_MODULES.

# args attribute -> value on CPU (what the flag in the module docstring sets).
CPU_SETTINGS = {
    "distributed_backend": "gloo",
    "transformer_impl": "local",
    "gradient_accumulation_fusion": False,
    "no_persist_layer_norm": True,
    "masked_softmax_fusion": False,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "bias_dropout_fusion": False,
}


class _CudaOnCpu(CpuCudaProxy):
    """`torch.cuda` as Megatron-LM's training modules see it in CPU mode: one device, the CPU
    (streams wait for nothing, as in Megatron-Core's CPU mode)."""

    Stream = NullStream

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def set_device(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self, *args: Any, **kwargs: Any) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_properties(self, *args: Any, **kwargs: Any) -> types.SimpleNamespace:
        # validate_args asks the architecture with TP or CP > 1 (CUDA_DEVICE_MAX_CONNECTIONS).
        return types.SimpleNamespace(name="cpu", major=0, minor=0, multi_processor_count=1,
                                     total_memory=_host_memory_bytes())

    def get_device_capability(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return (0, 0)

    def get_rng_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, *args: Any, **kwargs: Any) -> None:
        pass  # the CPU generator's state is restored on its own


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _torch_with_cpu_cuda() -> types.ModuleType:
    proxy = cpu_torch_proxy()
    proxy.cuda = _CudaOnCpu()
    return proxy


def enable_megatron_lm_cpu_mode() -> None:
    """Let Megatron-LM's `pretrain(...)` run on CPU processes with gloo. Idempotent."""
    enable_cpu_mode()
    proxy = _torch_with_cpu_cuda()
    modules, fused_kernels = compat.megatron_lm_cpu_modules()
    for module in modules:
        patch_for_cpu(module, "torch", proxy)
    if fused_kernels is not None:  # 0.16 builds them with nvcc; nothing on CPU calls them
        patch_for_cpu(fused_kernels, "load", lambda args: None)
    # Warms up CUDA JIT fusions on tensors made with device="cuda"; there is nothing to warm.
    initialize = importlib.import_module("megatron.training.initialize")
    patch_for_cpu(initialize, "_warmup_jit_function", lambda *a, **k: None)  # 0.19: tp_size=
    # --sequence-parallel: Megatron's local torch norm refuses it (only TE/apex norms mark
    # their parameters for the TP all-reduce); spec.TorchNorm marks them.
    norm = compat.local_spec_torch_norm()
    patch_for_cpu(norm, "__new__", _sequence_parallel_torch_norm(norm.__new__))
    # --save / --load: checkpointing's CUDA RNG state, its "cuda" iteration tensor and the RNG
    # tracker states it checks (the module docstring).
    checkpointing = checkpoint_versions.megatron_lm_checkpointing()
    patch_for_cpu(checkpointing, "torch", proxy)
    patch_for_cpu(checkpointing, "tensor_parallel",
                  _TensorParallelForCheckpoints(checkpointing.tensor_parallel))


#: The one entry of the RNG tracker states a CPU checkpoint holds (a marker; loading drops it).
CPU_TRACKER_MARK = "terapipe-cpu: no CUDA generators"


class _CheckpointedCpuTracker:
    """Megatron's RNG tracker as Megatron-LM's checkpointing sees it on CPU. The CPU tracker
    holds no generators (its forks run on the CPU generator, which a checkpoint saves as
    `torch_rng_state`), but loading treats empty tracker states as a checkpoint without RNG
    state and exits; so the saved states hold one marker entry, which loading drops."""

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker

    def get_states(self) -> dict:
        states = self._tracker.get_states()
        return states if states else {CPU_TRACKER_MARK: torch.empty(0, dtype=torch.uint8)}

    def set_states(self, states: dict) -> None:
        self._tracker.set_states({k: v for k, v in states.items() if k != CPU_TRACKER_MARK})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tracker, name)


class _TensorParallelForCheckpoints(types.ModuleType):
    """`megatron.core.tensor_parallel` as Megatron-LM's checkpointing sees it on CPU: the RNG
    tracker it gets is `_CheckpointedCpuTracker`; everything else is the module's own."""

    def __init__(self, tensor_parallel: types.ModuleType) -> None:
        super().__init__(tensor_parallel.__name__)
        self._tensor_parallel = tensor_parallel

    def get_cuda_rng_tracker(self, *args: Any, **kwargs: Any) -> _CheckpointedCpuTracker:
        return _CheckpointedCpuTracker(self._tensor_parallel.get_cuda_rng_tracker(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tensor_parallel, name)


def _sequence_parallel_torch_norm(original: Callable) -> Callable:
    def new(cls, config, hidden_size: int, eps: float = 1e-5, *args: Any, **kwargs: Any):
        if getattr(config, "sequence_parallel", False):
            return TorchNorm(config, hidden_size, eps=eps)
        return original(cls, config, hidden_size, eps, *args, **kwargs)

    return new


def apply_cpu_settings(args) -> list[str]:
    """Set the flags CPU runs need (CPU_SETTINGS) on Megatron-LM's parsed args; returns the
    `> ...` log lines naming what changed. Raises ValueError for what the user must choose."""
    if getattr(args, "save", None) and getattr(args, "ckpt_format", "torch_dist") == "torch_dist" \
            and importlib.util.find_spec("psutil") is None:
        raise ValueError(
            f"--save {args.save}: Megatron-Core's torch_dist checkpoint writer processes need "
            "psutil (without it they stop before reporting and the save waits for them "
            "forever): pip install psutil")
    changed = []
    model_parallel = max(getattr(args, "tensor_model_parallel_size", 1) or 1,
                         getattr(args, "context_parallel_size", 1) or 1) > 1
    if model_parallel and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        # validate_args asks for it with TP or CP > 1 (GPU kernel ordering); nothing on CPU
        # reads it, and it is what a GPU run of the same flags sets.
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        changed.append("> terapipe cpu: CUDA_DEVICE_MAX_CONNECTIONS=1 (asked for with TP or CP > 1)")
    for name, value in CPU_SETTINGS.items():
        if hasattr(args, name) and getattr(args, name) != value:
            changed.append(f"> terapipe cpu: {name} {getattr(args, name)!r} -> {value!r}")
            setattr(args, name, value)
    return changed


def release_process_groups() -> None:
    """After the script ended cleanly (returned, or sys.exit(0)): destroy torch's process
    groups while the interpreter is whole. Megatron-LM's script leaves them to interpreter
    exit, where a gloo group's worker thread can still be letting go of a finished operation's
    tensors; a thread that needs the GIL once finalization has begun is stopped inside C++ and
    the process aborts ('terminate called without an active exception', SIGABRT after
    training: 3 of 5 Megatron-LM matrices on CPU had one). A group goes when its last
    reference does, and its destructor first waits for its work and joins its threads. Not
    after a failure: a rank that failed may leave its peers inside a collective, and tearing
    down then could hang."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    groups = [weakref.ref(group) for group in torch.distributed.distributed_c10d._world.pg_names]
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    alive = {id(group()): group() for group in groups if group() is not None}
    _drop_references(vars(parallel_state), alive, parallel_state)
    for obj in gc.get_objects():
        if type(obj) is dict:
            _drop_references(obj, alive)
        elif _is_megatron_object(obj):
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                _drop_references(attributes, alive, obj)


def _is_megatron_object(obj: Any) -> bool:
    module = type(obj).__module__  # a descriptor on some types
    return isinstance(module, str) and module.split(".")[0] in ("megatron", "megatron_terapipe")


def _drop_references(values: dict, groups: dict[int, Any], owner: Any = None) -> None:
    """Set to None the entries of `values` (or, with `owner`, those attributes of it) that are
    one of `groups` (by id). Still held after the destroy calls: parallel_state's
    intra-partial data-parallel groups with CP (0.16 and 0.19 leave them set), MoE's loss
    tracker, and what the model's objects and TeraPipe's transports hold; those outlive the
    script in reference cycles (Megatron's DDP keeps its gradient hooks' nodes, whose hooks
    hold the DDP: a cycle through C++ that gc cannot break). Not gc.collect(): it would also
    run the data loaders' teardown, which waits 10 s and more per loader for its worker
    processes. Nothing runs the model any more."""
    for name in [name for name, value in values.items() if id(value) in groups]:
        if owner is None:
            values[name] = None
        else:
            setattr(owner, name, None)
