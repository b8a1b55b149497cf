"""Running one function on several gloo processes and collecting every rank's result or failure."""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from .machine_lock import one_run_at_a_time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


#: gloo for host tensors, NCCL for CUDA tensors: CUDA collectives that a CUDA graph can capture
#: (Megatron's cross entropy all-reduces over the TP group even at TP=1; gloo's cannot be).
GLOO_AND_NCCL = "cpu:gloo,cuda:nccl"

#: What the workers' parent process imports once, so that each worker starts with it imported
#: (a 2-rank call that only sets up Megatron's parallel state: 7.4-9.0 s with fresh
#: interpreters, 0.24-0.69 s after the first from the server on the 2-core CI machine;
#: benchmarks/bench_spawn.py, benchmarks/results/cpu/spawn.json).
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.models.gpt", "megatron.core.pipeline_parallel.schedules",
           "megatron.core.transformer.transformer_config", "megatron_terapipe")


def _context():
    """Workers fork from a server that has PRELOAD imported (forkserver), on machines without a
    GPU; on a GPU machine a fresh interpreter each (spawn), so no CUDA state can be forked."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server first starts
    return ctx


def _entry(rank: int, world_size: int, port: int, target: str, args: tuple, queue,
           threads: int, pg_timeout: float, backend: str, environ: dict[str, str]) -> None:
    # The caller's environment as it is now (a forkserver's own is as it was at its start),
    # with this rank's additions, all before the process group: NCCL's set-up asks the CUDA
    # driver for its devices, after which variables it reads at start (MPS's SM share) are
    # ignored.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    import warnings

    warnings.filterwarnings("ignore")
    try:
        torch.distributed.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        function = _resolve(target)
        # What is alive now (the preloaded modules, the target's) lives as long as the worker:
        # frozen, the full collection each case's release runs (process_groups.py) skips it
        # instead of walking torch's and Megatron's objects again for every case.
        gc.freeze()
        result = function(rank, world_size, *args)
        # Plain pickle copies tensors into the message; the queue's own pickler would hand
        # them over as shared memory that dies with this process.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report every failure, then exit so peers see the socket close
        queue.put((rank, False, traceback.format_exc()))
        queue.close()
        queue.join_thread()  # the report must reach the parent before this process dies
        sys.stderr.flush()
        os._exit(1)
    try:
        torch.distributed.destroy_process_group()
    except Exception:
        pass


class WorkerError(RuntimeError):
    """A worker failed. `reports` maps rank -> traceback for every rank that reported a failure;
    `killed` lists ranks the harness had to stop because they neither finished nor failed."""

    def __init__(self, message: str, reports: dict[int, str], killed: list[int]) -> None:
        super().__init__(message)
        self.reports = reports
        self.killed = killed


def _collect(procs: list, queue, target: str, timeout: float, grace: float,
             results: dict[int, Any], failures: dict[int, str]) -> None:
    """Fill `results` and `failures` until every rank reported, or the deadline passed."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < world_size:
        now = time.monotonic()
        if now >= deadline:
            if failures:
                return
            raise TimeoutError(f"{target} did not finish within {timeout:.0f} s on {world_size} ranks")
        try:
            rank, ok, payload = queue.get(timeout=min(deadline - now, 1.0))
        except Exception:  # nothing arrived: a rank may have died without reporting
            for r, p in enumerate(procs):
                if p.exitcode not in (None, 0) and r not in failures and r not in results:
                    failures[r] = f"process exited with code {p.exitcode} without a report"
            continue
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
            deadline = min(deadline, time.monotonic() + grace)


def spawn(world_size: int, target: str, *args: Any, timeout: float = 600.0, threads: int = 1,
          pg_timeout: float = 120.0, grace: float = 30.0, backend: str = "gloo",
          rank_environ: Optional[dict[int, dict[str, str]]] = None) -> list[Any]:
    """Run `target(rank, world_size, *args)` ("module:function") on `world_size` gloo processes
    (`backend`: another torch.distributed backend, e.g. GLOO_AND_NCCL). `rank_environ[r]`:
    variables rank r's environment gets on top of the caller's, before anything else runs.

    Returns each rank's result. If any rank fails, the others get `grace` seconds to fail or
    finish on their own (a dead peer's closed socket ends their waits), then are killed;
    WorkerError carries every report. If the run exceeds `timeout` seconds, TimeoutError.
    Runs of 2 or more ranks under pytest wait for the machine's lock (machine_lock.py) first.
    """
    with one_run_at_a_time() if world_size > 1 else contextlib.nullcontext():
        return _spawn(world_size, target, args, timeout, threads, pg_timeout, grace, backend,
                      rank_environ)


def _spawn(world_size: int, target: str, args: tuple, timeout: float, threads: int,
           pg_timeout: float, grace: float, backend: str,
           rank_environ: Optional[dict[int, dict[str, str]]]) -> list[Any]:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    extra = rank_environ or {}
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, target, args, queue, threads,
                                              pg_timeout, backend,
                                              {**os.environ, **extra.get(r, {})}), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    killed: list[int] = []
    try:
        _collect(procs, queue, target, timeout, grace, results, failures)
    finally:
        for r, p in enumerate(procs):
            p.join(timeout=2 if failures else 10)
            if p.is_alive():
                if r not in results and r not in failures:
                    killed.append(r)
                p.kill()
                p.join()
    if failures:
        first = min(failures)
        text = "\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(failures.items()))
        raise WorkerError(f"{len(failures)} of {world_size} ranks failed (first: rank {first})\n{text}",
                          failures, killed)
    return [results[r] for r in range(world_size)]
