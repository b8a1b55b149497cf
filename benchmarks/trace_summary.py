"""What a torch.profiler trace says about where an iteration's time went: host vs GPU.

Reads Chrome traces as torch.profiler writes them (Megatron-LM's `--profile
--use-pytorch-profiler` writes one per rank under --tensorboard-dir) and prints, per trace:
the wall span of the profiled steps, the time the GPU was busy (the union of its kernel and
memcpy intervals), kernel launches, host synchronisations (the CUDA runtime calls that wait for
the device) with the time the host spent in them, the CPU ops and Python functions with the
most time of their own, and for the top ops and the syncs the source lines they were called
from (the innermost Python frame outside torch, where the trace has stacks). Writes the same
as JSON.

    python benchmarks/trace_summary.py TRACE.json [TRACE.json ...] --out summary.json

gpu_session.sh's `megatron-lm-profile` part runs it on the device, on the traces of
`pretrain_gpt.py` under terapipe and 1f1b, so that only the summaries come back.
"""

from __future__ import annotations

import argparse
import bisect
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
SOURCE_FRAME = re.compile(r"\.py\(\d+\): ")  # a with_stack frame of a source file, not a built-in


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
    sync_wait_ms: dict[str, float] = field(default_factory=dict)  # host time inside the syncs
    # per top host op and per sync: the calling source lines with the most time (with_stack)
    callers_ms: dict[str, list[tuple[str, float, int]]] = field(default_factory=dict)


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


class _Frames:
    """The Python frames of source files (not torch's own), per thread, to find the innermost
    one around an event."""

    def __init__(self, events: list[dict]) -> None:
        self.by_thread: dict[object, tuple[list[float], list[dict]]] = {}
        frames = collections.defaultdict(list)
        for e in events:
            if (e.get("cat") == "python_function" and SOURCE_FRAME.search(str(e["name"]))
                    and "torch/" not in str(e["name"])):
                frames[e["tid"]].append(e)
        for tid, found in frames.items():
            found.sort(key=lambda e: e["ts"])
            self.by_thread[tid] = ([e["ts"] for e in found], found)

    def caller(self, event: dict, look_back: int = 20000) -> str:
        starts, frames = self.by_thread.get(event["tid"], ([], []))
        i, end = bisect.bisect_right(starts, event["ts"]), event["ts"] + event["dur"]
        for frame in reversed(frames[max(0, i - look_back):i]):  # the latest-starting is innermost
            if frame["ts"] + frame["dur"] >= end:
                return ADDRESS.sub("", str(frame["name"]))
        return "(no source frame)"


def _callers(events: list[dict], names: list[str], frames: _Frames,
             top: int = 3) -> dict[str, list[tuple[str, float, int]]]:
    """For each name: the calling source lines with the most total time, and their calls."""
    wanted = set(names)
    totals: dict[str, dict[str, list]] = {n: collections.defaultdict(lambda: [0.0, 0]) for n in names}
    for e in events:
        if e.get("name") in wanted and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"):
            slot = totals[e["name"]][frames.caller(e)]
            slot[0] += e["dur"]
            slot[1] += 1
    return {n: [(c, round(t / 1000.0, 3), int(k)) for c, (t, k) in
                sorted(by.items(), key=lambda kv: -kv[1][0])[:top]]
            for n, by in totals.items() if by and frames.by_thread}


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

    host_ops = ranked("cpu_op")
    syncs = {name: n for name, n in runtime.items() if name in SYNCS}
    waits = collections.Counter()
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in SYNCS:
            waits[e["name"]] += e["dur"] / 1000.0
    return TraceSummary(
        trace=os.path.basename(path), steps=len(steps), wall_ms=wall,
        gpu_busy_ms=_union_ms(device),
        kernels=sum(1 for e in events if e.get("cat") == "kernel"),
        launches=sum(n for name, n in runtime.items() if name.startswith(LAUNCHES)),
        syncs=syncs, top_host_ops_ms=host_ops, top_python_ms=ranked("python_function"),
        sync_wait_ms={name: round(ms, 3) for name, ms in waits.items()},
        callers_ms=_callers(events, [name for name, *_ in host_ops[:5]] + sorted(syncs),
                            _Frames(events)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--out", help="JSON file for the summaries")
    args = parser.parse_args(argv)
    summaries = [summarize(path) for path in args.traces]
    for s in summaries:
        print(f"> {s.trace}: {s.steps} steps, wall {s.wall_ms:.1f} ms, GPU busy "
              f"{s.gpu_busy_ms:.1f} ms, {s.kernels} kernels, {s.launches} launches, syncs {s.syncs}")
        print(f">   host time in the syncs: {s.sync_wait_ms}")
        for title, rows in (("host ops", s.top_host_ops_ms), ("Python", s.top_python_ms)):
            print(f">   {title} by time of their own:")
            for name, ms, calls in rows:
                print(f">     {ms:9.2f} ms {calls:6d}x  {name}")
        for name, rows in s.callers_ms.items():
            print(f">   {name} called from:")
            for caller, ms, calls in rows:
                print(f">     {ms:9.2f} ms {calls:6d}x  {caller}")
    if args.out:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import provenance, script_command

        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(script_command(__file__, argv)),
                       "traces": [asdict(s) for s in summaries]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
