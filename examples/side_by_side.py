"""After training: TeraPipe against Megatron's own 1F1B on the same model, with the planner's
prediction beside each measured time."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_log import is_logging_rank, log


def compare_schedules(args, model, common: dict, data, report, plan, device) -> None:
    """Time `args.compare_iters` iterations (forward + backward) of each schedule, interleaved.

    Both run on the same model, weights and batches; gradients are cleared after each and no
    optimizer step is taken. A round runs TeraPipe, then Megatron's 1F1B (the order alternates
    from round to round); each time is the wall time between two barriers of all ranks.
    One untimed round of each comes first.
    """
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving as megatron_1f1b,
    )
    from megatron_terapipe import forward_backward_terapipe

    schedules = {"terapipe": forward_backward_terapipe, "megatron": megatron_1f1b}
    n = args.compare_iters
    log(f"> timing {n} more iteration{'s' if n > 1 else ''} of each schedule on the same model "
        f"(forward + backward, interleaved{'; medians' if n > 1 else ''})")
    times = _timed_rounds(schedules, n, model, common, data, device)
    model.zero_grad_buffer()
    slices = sum(len(ts) for ts in plan.token_slices)
    _print_comparison(statistics.median(times["terapipe"]), statistics.median(times["megatron"]),
                      slices, report)
    _warn_if_loaded(device)


def _timed_rounds(schedules: dict, rounds: int, model, common: dict, data,
                  device) -> dict[str, list[float]]:
    tty = sys.stdout.isatty()

    def timed(name: str) -> float:
        model.zero_grad_buffer()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        schedules[name](data_iterator=data, forward_only=False, **common)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - start

    for name in schedules:
        timed(name)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in schedules}
    for r in range(rounds):
        for name in (("terapipe", "megatron") if r % 2 == 0 else ("megatron", "terapipe")):
            times[name].append(timed(name))
        if tty and is_logging_rank():
            print(f"\r>   round {r + 1}/{rounds}", end="", flush=True)
    if tty and is_logging_rank():
        print("\r\033[K", end="", flush=True)
    return times


def _row(label: str, value: str) -> str:
    return f">   {label} {'.' * max(3, 28 - len(label))} {value}"


def _predicted(seconds) -> str:
    return f" (planner predicted {seconds * 1e3:.1f} ms)" if seconds else ""


def _print_comparison(tera: float, mega: float, slices: int, report) -> None:
    cells = "token slice" if slices == 1 else "token slices"
    log(_row(f"TeraPipe ({slices} {cells})", f"{tera * 1e3:.1f} ms per iteration"
             + _predicted(report.iteration_time if report else None)))
    log(_row("Megatron 1F1B", f"{mega * 1e3:.1f} ms per iteration"
             + _predicted(report.baseline_time if report else None)))
    line = _row("speedup", f"{mega / tera:.2f}x")
    if report and report.iteration_time and report.baseline_time:
        line += f" (planner predicted {report.baseline_time / report.iteration_time:.2f}x)"
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    log(f"{bold}{line}{plain}")


def _warn_if_loaded(device) -> None:
    cores = os.cpu_count() or 1
    if device.type == "cpu" and hasattr(os, "getloadavg") and os.getloadavg()[0] > 1.5 * cores:
        log(f">   note: other processes shared these {cores} cores (load average "
            f"{os.getloadavg()[0]:.1f}); TeraPipe gains by running its stages at the same "
            "time, one core each, so timings under load are not representative")
