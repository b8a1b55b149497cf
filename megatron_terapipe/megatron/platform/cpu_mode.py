"""CPU mode: let Megatron-Core run on CPUs with gloo (tests, examples, laptops).

Megatron-Core assumes CUDA in a handful of places that matter for training on one node:
buffers allocated on `torch.cuda.current_device()` (P2P receive buffers, DDP grad buffers, the
global memory buffer), `torch.cuda.synchronize()` in P2P shape exchange, token counters created
with `device="cuda"` in the built-in schedules, CUDA stream queries in the DDP grad sync
(0.19), the CUDA RNG tracker seeding, and the checks of the optimizers' constructors
(distributed and 16-bit) and of gradient clipping that tensors are CUDA ones (by `Tensor.type()`
name). CPU mode points these at the CPU (the modules it touches are listed and version-checked
in compat.py), and keeps freed host memory in the process as CUDA's caching allocator keeps
device memory (`keep_freed_host_memory`). It is opt-in and process-wide; never call it in a GPU job.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from typing import Any, Callable, Iterator, Optional

import torch

from . import compat
from .cpu_sends import P2PTorchProxy, p2p_module

_ENABLED = False
_PATCHED: list[tuple[Any, str, Any]] = []  # (owner, attribute, original), in patching order
_MISSING = object()  # an attribute that did not exist before it was patched


def patch_for_cpu(owner: Any, name: str, value: Any) -> None:
    """Set `owner.name` to `value` until `disable_cpu_mode` puts the original back."""
    _PATCHED.append((owner, name, getattr(owner, name, _MISSING)))
    setattr(owner, name, value)


class NullStream:
    """A CUDA stream stand-in on CPU: work on CPU is already ordered, so every stream is the
    same one (MoE's dispatcher compares the current stream with its side stream)."""

    def __init__(self, *_a: Any, **_k: Any) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NullStream)

    def __hash__(self) -> int:
        return 0

    def record_event(self, *_a: Any, **_k: Any) -> "NullEvent":
        return NullEvent()

    def wait_event(self, *_a: Any, **_k: Any) -> None:
        return None

    def wait_stream(self, *_a: Any, **_k: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class NullEvent:
    """A CUDA event stand-in on CPU: already complete."""

    def __init__(self, *_a: Any, **_k: Any) -> None:
        pass

    def record(self, *_a: Any, **_k: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, *_a: Any, **_k: Any) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuCudaProxy(types.ModuleType):
    """`torch.cuda` as seen by a Megatron module in CPU mode: stream queries answer a stream
    that waits for nothing (0.19's grad sync asks for the current stream unconditionally)."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    Stream = NullStream
    Event = NullEvent

    def current_stream(self, *_a: Any, **_k: Any) -> NullStream:
        return NullStream()

    default_stream = current_stream

    def stream(self, *_a: Any, **_k: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorchProxy(types.ModuleType):
    """`torch` as seen by a Megatron module, with device='cuda' factory calls mapped to CPU
    (and, without CUDA, CUDA stream queries answered by `CpuCudaProxy`)."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")

    def __init__(self) -> None:
        super().__init__("torch")
        self._cuda = None if torch.cuda.is_available() else CpuCudaProxy()

    def __getattr__(self, name: str) -> Any:
        if name == "cuda" and self._cuda is not None:
            return self._cuda
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            def factory(*args, __f=attr, **kwargs):
                dev = kwargs.get("device")
                if dev is not None and str(dev).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return __f(*args, **kwargs)
            return factory
        return attr


def cpu_torch_proxy() -> types.ModuleType:
    """A `torch` for a Megatron module on CPU: device='cuda' factories make CPU tensors, and
    without CUDA, stream queries answer a stream that waits for nothing."""
    return _CpuTorchProxy()


def cpu_model_parallel_seed(seed: int, *_ignored_args: Any, **_ignored: Any) -> None:
    """Stand-in for `model_parallel_cuda_manual_seed` on CPU: one seed, a CUDA-free tracker.

    Megatron-LM calls it as (seed, te_rng_tracker, inference_rng_tracker, cudagraph_rng), all
    positional; none of them means anything without CUDA."""
    torch.manual_seed(seed)
    compat.rng_module().initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def enable_cpu_mode() -> None:
    """Make Megatron-Core's CUDA-only calls work on CPU. Idempotent."""
    global _ENABLED
    if _ENABLED:
        return
    modules = compat.cpu_mode_modules()  # checked before anything is patched
    tp_random = compat.rng_module()
    patch_for_cpu(torch.cuda, "current_device", lambda: torch.device("cpu"))
    patch_for_cpu(torch.cuda, "synchronize", lambda *a, **k: None)
    if not torch.cuda.is_available():
        # Tied embeddings move their weight with `.cuda()` before the first/last-stage
        # all-reduce; without CUDA, the tensor stays where it is.
        patch_for_cpu(torch.Tensor, "cuda", lambda self, *a, **k: self)

    proxy = _CpuTorchProxy()
    for module in modules:
        patch_for_cpu(module, "torch", proxy)

    from megatron.core import tensor_parallel

    patch_for_cpu(tp_random, "model_parallel_cuda_manual_seed", cpu_model_parallel_seed)
    patch_for_cpu(tensor_parallel, "model_parallel_cuda_manual_seed", cpu_model_parallel_seed)
    # Activation checkpointing saves and restores the CUDA RNG next to the CPU one; on CPU
    # there is no CUDA generator, and the CPU state is already saved by the checkpoint.
    patch_for_cpu(tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    patch_for_cpu(tp_random, "_set_cuda_rng_state", lambda *a, **k: None)
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _moe_on_cpu({m.__name__: m for m in modules})
    _optimizers_on_cpu({m.__name__: m for m in modules})
    p2p = p2p_module()  # sends keep their storage until waited on (cpu_sends.py)
    patch_for_cpu(p2p, "torch", P2PTorchProxy(p2p.torch))
    keep_freed_host_memory()
    _ENABLED = True


@contextlib.contextmanager
def _cpu_tensors_named_cuda() -> Iterator[None]:
    """`Tensor.type()` names a CPU tensor by its CUDA type ('torch.cuda.FloatTensor'), as
    Megatron-Core's optimizers check parameter types by name; with arguments it is unchanged."""
    original = torch.Tensor.type

    def type_name(self, *args: Any, **kwargs: Any):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.is_cuda or not isinstance(name, str):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_name
    try:
        yield
    finally:
        torch.Tensor.type = original


def _naming_cpu_tensors_cuda(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any):
        with _cpu_tensors_named_cuda():
            return function(*args, **kwargs)

    return wrapped


def _optimizers_on_cpu(modules: dict[str, types.ModuleType]) -> None:
    """The constructors of the distributed optimizer and of the 16-bit one (bf16/fp16 without
    it), and gradient clipping, accept parameters and gradients by CUDA type name only
    ('torch.cuda.FloatTensor', 'torch.cuda.BFloat16Tensor'); inside them CPU tensors are named
    so (the optimizers' steps already run on CPU through the modules' `torch`)."""
    from megatron.core.optimizer import DistributedOptimizer

    optimizer = modules["megatron.core.optimizer.optimizer"]  # clips through its imported name
    for name in ("clip_grad_by_total_norm_fp32", "Float16OptimizerWithFloat16Params"):
        if not callable(getattr(optimizer, name, None)):
            raise compat.moved("CPU mode", f"optimizer.{name} is gone")
    for cls in (DistributedOptimizer, optimizer.Float16OptimizerWithFloat16Params):
        patch_for_cpu(cls, "__init__", _naming_cpu_tensors_cuda(cls.__init__))
    patch_for_cpu(optimizer, "clip_grad_by_total_norm_fp32",
                  _naming_cpu_tensors_cuda(optimizer.clip_grad_by_total_norm_fp32))


def _moe_on_cpu(modules: dict[str, types.ModuleType]) -> None:
    moe_utils = modules["megatron.core.transformer.moe.moe_utils"]
    if not hasattr(moe_utils, "te_general_gemm"):
        # Without Transformer Engine the MoE router's GEMM reads a name its import left unset.
        patch_for_cpu(moe_utils, "te_general_gemm", None)
    # The alltoall dispatcher moves its split sizes to the host as numpy arrays for the
    # all-to-all; a CPU tensor was left as it is, which all_to_all_single does not take.
    dispatcher = modules["megatron.core.transformer.moe.token_dispatcher"]
    to_host = dispatcher.maybe_move_tensor_to_cpu

    def to_host_numpy(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    patch_for_cpu(dispatcher, "maybe_move_tensor_to_cpu", to_host_numpy)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_host_memory(mmap_threshold: int = 512 << 20) -> bool:
    """Keep freed host memory in the process, as CUDA's caching allocator keeps device memory.

    By default glibc serves large tensors with fresh mmaps and hands freed heap memory back to
    the OS, so every iteration page-faults its activations in again (the kernel zeroes each
    page). Token slices make many mid-sized allocations, which is where this hurts most:
    measured on this project's 2-layer, hidden-512 CPU model with 4 microbatches, a TeraPipe
    iteration took 31k page faults (about 5% of its time) and Megatron's own schedule none. With
    tensors up to `mmap_threshold` served from a heap that is not trimmed, TeraPipe took 20.
    Called by `enable_cpu_mode`. Leaves the allocator alone when the user tuned it (MALLOC_*_
    or GLIBC_TUNABLES set) and where glibc is not the C library. Returns whether it changed
    the settings."""
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ) or \
            "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return False
    # glibc caps the mmap threshold (32 MiB on older versions): fall back to the cap.
    if not mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold)):
        if not mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(32 << 20)):
            return False
    mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))
    mallopt(_M_TOP_PAD, ctypes.c_int(64 << 20))
    return True


def disable_cpu_mode() -> None:
    """Undo `enable_cpu_mode` (and the launcher's `--terapipe-cpu`): every patched torch,
    Megatron-Core and Megatron-LM name gets its original back
    (glibc's malloc settings stay, they only keep freed memory). Idempotent."""
    global _ENABLED
    while _PATCHED:
        owner, name, original = _PATCHED.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _ENABLED = False


def pin_to_core(local_rank: int, local_world_size: int) -> Optional[int]:
    """Bind this process (every thread: the stage's compute and gloo's worker threads) to its
    own core, as a GPU job binds one GPU per rank. Unbound, the OS moves the stages and their
    gloo threads between cores, where they preempt the other stage's compute. Measured on 2
    vCPUs (9 interleaved rounds, same processes): binding the compute thread made a 2-stage
    TeraPipe iteration 5% faster than no binding, and binding gloo's threads as well made it
    another 4% faster (1.477 s against 1.542 s); Megatron's own schedule did not change
    (2.598 s against 2.599 s). Call it after the process group exists, so that the threads it
    started are bound too (threads started later inherit the binding).
    Returns the core, or None (nothing pinned) without enough cores for every local rank or
    on systems without CPU affinity."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if local_world_size <= 0 or len(cores) < local_world_size:
        return None
    core = cores[local_rank % local_world_size]
    for thread in process_thread_ids():
        try:
            os.sched_setaffinity(thread, {core})
        except OSError:  # the thread ended meanwhile
            pass
    return core


def process_thread_ids() -> list[int]:
    """Kernel ids of this process's threads (0, the calling thread, where /proc is missing)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
