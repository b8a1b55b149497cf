"""How a measurement reads time: the host's wall clock, or the GPU's own time.

`wall` (the default) synchronises the device at every mark and reads the host's clock: what an
eager cell costs, host launches included. On a GPU a short eager slice is bound by its host
time (on an H100, 1.2-1.3 ms per 4096-wide layer forward from 8 to 672 tokens), which a length polynomial fits poorly and a CUDA-graphed cell does not pay.

`device` measures what the GPU spends on the work: it holds the GPU in a sleep kernel while the
host queues the whole timed region, then times the region with CUDA events, so no launch gap
lands inside it. That is what a cell replayed from a CUDA graph costs (`--terapipe-cuda-graphs`),
less the replay's own launch. If the host had not queued everything before the sleep ended
(the region's start event had already run), the hold doubles and the region runs again. After
every region the hold is sized afresh from what it saw (twice the host's queueing time, in the
sleep's own cycles per second, never under the first hold), so that one short region does not
slow every later one; the profile records its holds.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

TIMINGS = ("wall", "device")


class HoldTooShort(Exception):
    """The GPU reached the timed region before the host had queued all of it."""


class WallClock:
    """Host wall time between marks, the device synchronised at each (sync: a no-op on CPU)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.marks: list[float] = []

    def begin(self) -> None:
        self.sync()
        self.marks = [time.perf_counter()]

    def mark(self) -> None:
        self.sync()
        self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks, the first from begin()."""
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def retried(self, region: Callable[[], Any]) -> Any:
        return region()


class DeviceClock:
    """GPU seconds between marks, the host's launches queued behind a sleep kernel (make_clock
    checks that the measurement runs on a GPU)."""

    def __init__(self, cuda: Any = None, hold_cycles: int = 20_000_000, tries: int = 7,
                 now: Callable[[], float] = time.perf_counter, margin: float = 2.0) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        if not hasattr(cuda, "_sleep"):
            raise RuntimeError("--timing device needs torch.cuda._sleep, which this torch "
                               "lacks: use --timing wall")
        self.cuda, self.hold_cycles, self.tries = cuda, hold_cycles, tries
        self.least_cycles, self.now, self.margin = hold_cycles, now, margin
        self.events: list[Any] = []
        self.regions = self.reruns = 0
        self.largest_hold = hold_cycles

    def begin(self) -> None:
        self.cuda.synchronize()
        self.held_from = self.cuda.Event(enable_timing=True)
        self.held_from.record()
        self.cuda._sleep(self.hold_cycles)  # the GPU waits here while the host queues the region
        self.largest_hold = max(self.largest_hold, self.hold_cycles)
        self.queue_started = self.now()
        self.events = []
        self.mark()

    def mark(self) -> None:
        event = self.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    def spans(self) -> list[float]:
        queueing = self.now() - self.queue_started
        queued_in_time = not self.events[0].query()  # still behind the sleep once all is queued
        self.cuda.synchronize()
        self.regions += 1
        self._size_hold(queueing, self.held_from.elapsed_time(self.events[0]) / 1e3, queued_in_time)
        if not queued_in_time:
            self.reruns += 1
            raise HoldTooShort
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:])]

    def _size_hold(self, queueing: float, held: float, in_time: bool) -> None:
        """The next region's hold: `margin` x this region's queueing time in the sleep's cycles
        per second (`held`: GPU seconds from before the sleep to the region's start, the sleep's
        own length when the host was in time), at least the first hold; after a short hold (its
        `held` includes the wait for the host) at least twice it, so a rerun always waits longer."""
        need = self.margin * queueing * self.hold_cycles / held if held > 0 else 0
        floor = 2 * self.hold_cycles if not in_time else self.least_cycles
        self.hold_cycles = int(max(floor, need))

    def summary(self) -> dict:
        """What the holds did, for the profile's metadata."""
        return {"regions": self.regions, "reruns": self.reruns,
                "largest_hold_cycles": self.largest_hold, "first_hold_cycles": self.least_cycles}

    def retried(self, region: Callable[[], Any]) -> Any:
        """region() (which calls begin, mark and spans), again with a longer hold (spans sized
        it) each time the host was too slow to queue it."""
        for _ in range(self.tries):
            try:
                return region()
            except HoldTooShort:
                continue
        raise RuntimeError(
            f"--timing device: the host did not queue a timed region within a sleep of "
            f"{self.largest_hold} GPU cycles in {self.tries} tries (does the region "
            "synchronise with the device?): use --timing wall")


def clock_metadata(clock) -> dict:
    """A device clock's hold summary for a profile's metadata ({} for the wall clock)."""
    return {"device_clock": clock.summary()} if isinstance(clock, DeviceClock) else {}


def check_timing(timing: str) -> None:
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {', '.join(TIMINGS)}, got {timing!r}")


def make_clock(timing: str, sync: Callable[[], None], on_gpu: bool, cuda: Optional[Any] = None):
    """The clock for `timing` ("wall" or "device") of a measurement on the GPU or not."""
    check_timing(timing)
    if timing == "wall":
        return WallClock(sync)
    if not on_gpu:
        raise ValueError("--timing device measures GPU time, but this measurement runs on "
                         "the CPU: use --timing wall (the default)")
    return DeviceClock(cuda)


def timed(clock, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of fn() on `clock`, and its result (a device clock's HoldTooShort propagates:
    the caller's clock.retried reruns its whole region, fresh inputs and all)."""
    clock.begin()
    out = fn()
    clock.mark()
    return clock.spans()[0], out
