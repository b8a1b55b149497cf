"""Releasing what a worker's case set up in Megatron: every process group and its threads.

Workers run many cases in one process (a module fixture spawns each world once), and each case
calls Megatron's `initialize_model_parallel`. Megatron's `destroy_model_parallel` only forgets
its groups (but for its gloo data-parallel ones): each forgotten gloo group keeps its threads
(two `pt_gloo_runloop`, a `gloo_tcp_loop`) until the process ends, so a worker running all
equivalence cases of a world held thousands of threads. `release_model_parallel` destroys the
groups first. A destroyed gloo group still runs its threads until the last reference to it goes
(`shutdown` and `abort` leave them), so the release also drops the references Megatron keeps
past a case, breaks the cycle Megatron's DDP hooks make with their model, and collects the
case's unreachable models.
"""

from __future__ import annotations

import gc
import os
import sys
from collections import OrderedDict


def os_thread_count() -> int:
    """Threads of this process as the OS sees them (gloo's threads are native: `threading`
    does not list them)."""
    return len(os.listdir("/proc/self/task"))


def subgroups() -> list:
    """Every process group of this process but the default one, newest first."""
    from torch.distributed import distributed_c10d

    pg_map = getattr(getattr(distributed_c10d, "_world", None), "pg_map", None)
    if pg_map is None:  # Megatron's own destroy_model_parallel reads the same map
        import torch

        raise RuntimeError(
            f"torch {torch.__version__} keeps no torch.distributed.distributed_c10d._world.pg_map:"
            " tests/harness/process_groups.py needs another way to list the process groups")
    default = distributed_c10d.GroupMember.WORLD
    return [group for group in reversed(list(pg_map)) if group is not default]


def release_model_parallel() -> None:
    """Destroy every process group but the default one, then run Megatron's
    `destroy_model_parallel` and drop the destroyed groups Megatron still refers to.

    Every rank must call it (it starts with a barrier on the default group). After the barrier
    no rank uses a group any more, and destroying a group is local to each rank, so none blocks.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():
        dist.barrier()
        for group in subgroups():
            dist.destroy_process_group(group)
    parallel_state.destroy_model_parallel()
    _forget_groups(parallel_state)
    _clear_moe_tracker()
    _clear_rotary_caches()
    _break_ddp_hook_cycles()
    gc.collect()  # models of earlier cases sit in reference cycles, holding their groups


def holds_group(value) -> bool:
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(isinstance(v, dist.ProcessGroup) for v in value)


def _forget_groups(module) -> None:
    """Reset the module's globals that still hold groups: destroy_model_parallel leaves
    e.g. the partial data-parallel, hierarchical context-parallel and hybrid DP x CP groups."""
    for name, value in list(vars(module).items()):
        if not (name.startswith("_") and name[1:2].isupper()) or not holds_group(value):
            continue
        if isinstance(value, dict):
            value.clear()  # initialize_model_parallel fills these dicts in place
        else:
            setattr(module, name, None)


def _break_ddp_hook_cycles() -> None:
    """Megatron's DDP registers a backward hook on each parameter's grad accumulator (a C++
    autograd node it keeps in `grad_accs`), and the hook's closure holds the DDP: a cycle
    through the node that gc cannot follow. It kept every DDP-wrapped model of a worker alive,
    with the process groups it uses (the MoE 4-process batch: each layout's 16 gloo groups per
    rank). The hooks of DDPs still alive are emptied from their hook dicts; one pass over the
    objects made since the worker started (spawn.py freezes the rest)."""
    module = sys.modules.get("megatron.core.distributed.distributed_data_parallel")
    ddp = getattr(module, "DistributedDataParallel", None)
    if ddp is None:
        return
    # type(), not isinstance(): a weak proxy whose object is gone raises on __class__
    models = {id(obj) for obj in gc.get_objects() if issubclass(type(obj), ddp)}
    if not models:
        return
    for obj in gc.get_objects():
        if type(obj) is OrderedDict and obj and _holds_a_hook_of(obj, models):
            obj.clear()


def _holds_a_hook_of(hooks: OrderedDict, models: set[int]) -> bool:
    for function in hooks.values():
        for cell in getattr(function, "__closure__", None) or ():
            try:
                if id(cell.cell_contents) in models:
                    return True
            except ValueError:  # an empty cell
                continue
    return False


def _clear_moe_tracker() -> None:
    """MoE layers record their reduction groups with each auxiliary loss they log."""
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


# Classes whose `forward` is an lru_cache keyed by the module itself (Megatron 0.16 and 0.19).
_CACHED_FORWARDS = (
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding"),
)


def _clear_rotary_caches() -> None:
    """The rotary embeddings' caches keep up to 32 models' embeddings alive, each with its
    context-parallel group (2 leaked groups per equivalence case)."""
    for module_name, class_name in _CACHED_FORWARDS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        cache_clear = getattr(getattr(cls, "forward", None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


def gloo_threads() -> int:
    """This process's gloo worker threads (two `pt_gloo_runloop` per live gloo group)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            continue
    return count


def gloo_threads_around_release_at_exit(rank: int, world_size: int) -> tuple[int, int]:
    """Megatron's groups, a TeraPipe transport in a reference cycle (as the runtime's outlive
    the script) and a group in a dict beside a tensor (as MoE's loss tracker keeps them), then
    the launcher's release at the end of a CPU run: gloo threads before and after it."""
    import torch
    from megatron.core import parallel_state

    from megatron_terapipe.megatron.platform.lm_cpu import release_process_groups
    from megatron_terapipe.runtime.comm.transport import TorchTransport

    parallel_state.initialize_model_parallel(1, world_size)
    transport = TorchTransport(parallel_state.get_pipeline_model_parallel_group(), torch.float32,
                               torch.device("cpu"))
    transport.cycle = transport
    tracker = {"values": torch.zeros(1), "reduce_group": parallel_state.get_data_parallel_group()}
    tracker["self"] = tracker
    del transport, tracker
    torch.distributed.barrier()
    before = gloo_threads()
    release_process_groups()
    return before, gloo_threads()
