"""Logging in Megatron-LM's style: the iteration line, validation, and the loss it reports."""

from __future__ import annotations

import math
from datetime import datetime

import torch
import torch.distributed as dist


def is_logging_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1  # Megatron logs from the last rank


def log(msg: str) -> None:
    if is_logging_rank():
        print(msg, flush=True)


def log_rank0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def reduce_loss(losses: list, group) -> float:
    """Token-weighted mean over microbatches and data-parallel ranks ([sum, count] reports)."""
    from megatron.core import parallel_state

    total = torch.zeros(2)
    for rep in losses:
        total += rep["lm loss"].detach().float().cpu()
    if parallel_state.is_pipeline_last_stage():
        dist.all_reduce(total, group=group)
    return float(total[0] / total[1].clamp(min=1))


def log_iteration(args, iteration: int, global_batch: int, elapsed: float, loss: float,
                  grad_norm, ok: bool) -> None:
    tokens_per_s = global_batch * args.seq_length / elapsed
    log(f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
        f" consumed samples: {iteration * global_batch:10d} |"
        f" elapsed time per iteration (ms): {elapsed * 1000:.1f} |"
        f" tokens per second: {tokens_per_s:.0f} | learning rate: {args.lr:.6E} |"
        f" global batch size: {global_batch:5d} | lm loss: {loss:.6E} |"
        + (f" grad norm: {grad_norm:.3f} |" if grad_norm is not None else "")
        + ("" if ok else " skipped |"))


def log_validation(iteration: int, loss: float) -> None:
    log("-" * 100)
    log(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
        f" lm loss PPL: {math.exp(min(loss, 50)):.6E} |")
    log("-" * 100)
