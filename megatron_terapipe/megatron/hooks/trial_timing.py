"""How a trial iteration of `auto` is measured and agreed on: the wall clock after the
device's queued work, the largest time over all ranks (so every rank decides alike), rank 0's
answer broadcast, and the CUDA peak memory of the trial."""

from __future__ import annotations

import time
from typing import Any, Optional


def max_over_ranks(seconds: float) -> float:
    """The largest of every rank's `seconds` (torch.distributed's MAX; itself alone)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return seconds
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    box = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def broadcast_from_rank_zero(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (itself without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def wall_clock() -> float:
    """Seconds, after the device's queued work (CUDA) has finished."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def reset_cuda_peak() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def cuda_peak_memory() -> Optional[float]:
    """This rank's peak allocated bytes since the trial began (None off CUDA)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return float(torch.cuda.max_memory_allocated())
    return None
