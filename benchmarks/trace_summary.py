"""What a torch.profiler trace says about where an iteration's time went: host vs GPU.

Reads Chrome traces as torch.profiler writes them (Megatron-LM's `--profile
--use-pytorch-profiler` writes one per rank under --tensorboard-dir) and prints, per trace:
the wall span of the profiled steps, the time the GPU was busy (the union of its kernel and
memcpy intervals), kernel launches, host synchronisations (the CUDA runtime calls that wait for
the device), and the CPU ops and Python functions with the most time of their own. Writes the same as JSON.

    python benchmarks/trace_summary.py TRACE.json [TRACE.json ...] --out summary.json

gpu_session.sh's `megatron-lm-profile` part runs it on the device, on the traces of
`pretrain_gpt.py` under terapipe and 1f1b, so that only the summaries come back.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field

#: CUDA runtime calls after which the host waits for the device.
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")
ADDRESS = re.compile(r" (of \S+ )?object at 0x[0-9a-f]+")  # the same method of other objects
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


@dataclass
class TraceSummary:
    """One trace, summed over its profiled steps."""

    trace: str
    steps: int
    wall_ms: float
    gpu_busy_ms: float
    kernels: int
    launches: int
    syncs: dict[str, int] = field(default_factory=dict)
    top_host_ops_ms: list[tuple[str, float, int]] = field(default_factory=list)  # self time
    top_python_ms: list[tuple[str, float, int]] = field(default_factory=list)  # with_stack traces


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1000.0


def _self_times(ops: list[dict]) -> dict[str, list[float]]:
    """Per op name: total time not inside a nested op of the same thread, and calls."""
    by_thread: dict[object, list[dict]] = collections.defaultdict(list)
    for op in ops:
        by_thread[op["tid"]].append(op)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, time in children, duration]
        for op in thread_ops:
            while stack and stack[-1][0] <= op["ts"]:
                _close(stack.pop(), totals)
            if stack:
                stack[-1][2] += op["dur"]
            stack.append([op["ts"] + op["dur"], op["name"], 0.0, op["dur"]])
        while stack:
            _close(stack.pop(), totals)
    return totals


def _close(frame: list, totals: dict[str, list[float]]) -> None:
    end, name, children, duration = frame
    totals[name][0] += max(duration - children, 0.0)
    totals[name][1] += 1


def summarize(path: str, top: int = 15) -> TraceSummary:
    events = [e for e in _load(path) if e.get("ph") == "X"]
    if not events:
        raise ValueError(f"{path}: no complete events: not a torch.profiler Chrome trace")
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    span = steps or events
    wall = (max(e["ts"] + e["dur"] for e in span) - min(e["ts"] for e in span)) / 1000.0
    device = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = collections.Counter(e["name"] for e in events
                                  if e.get("cat") in ("cuda_runtime", "cuda_driver"))
    main_threads = {e["tid"] for e in steps}  # the training loop's (others wait on locks)

    def ranked(category: str) -> list[tuple[str, float, int]]:
        ops = [dict(e, name=ADDRESS.sub("", str(e["name"]))) for e in events
               if e.get("cat") == category and (not main_threads or e["tid"] in main_threads)]
        best = sorted(_self_times(ops).items(), key=lambda kv: -kv[1][0])[:top]
        return [(name, round(t / 1000.0, 3), int(n)) for name, (t, n) in best]

    return TraceSummary(
        trace=os.path.basename(path), steps=len(steps), wall_ms=wall,
        gpu_busy_ms=_union_ms(device),
        kernels=sum(1 for e in events if e.get("cat") == "kernel"),
        launches=sum(n for name, n in runtime.items() if name.startswith(LAUNCHES)),
        syncs={name: n for name, n in runtime.items() if name in SYNCS},
        top_host_ops_ms=ranked("cpu_op"), top_python_ms=ranked("python_function"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--out", help="JSON file for the summaries")
    args = parser.parse_args(argv)
    summaries = [summarize(path) for path in args.traces]
    for s in summaries:
        print(f"> {s.trace}: {s.steps} steps, wall {s.wall_ms:.1f} ms, GPU busy "
              f"{s.gpu_busy_ms:.1f} ms, {s.kernels} kernels, {s.launches} launches, syncs {s.syncs}")
        for title, rows in (("host ops", s.top_host_ops_ms), ("Python", s.top_python_ms)):
            print(f">   {title} by time of their own:")
            for name, ms, calls in rows:
                print(f">     {ms:9.2f} ms {calls:6d}x  {name}")
    if args.out:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import provenance, script_command

        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(script_command(__file__, argv)),
                       "traces": [asdict(s) for s in summaries]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
