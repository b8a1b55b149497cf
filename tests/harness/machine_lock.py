"""One multi-process run at a time on the machine, across every pytest session running on it.

.ci/run runs the 0.19 session beside the 0.16 default run. Each pipeline test starts 2 to 4
processes; two of them at once on the 2-core CI machine put the load average at 4 to 12.
Under this lock a pipeline test of one session waits (asleep, out of the load average) while
the other's runs, and the single-process tests of either fill the core a pipeline leaves idle
while one stage waits for the other.

A session run with TERAPIPE_TEST_LOCK_YIELD=1 (.ci/run's background) also lets any waiting
session go first: its runs fill the default run's single-process stretches instead of making
the default run, the longest, wait.

conftest.py names the lock file in TERAPIPE_TEST_LOCK, so only test sessions take it (a
benchmark's `spawn` does not); TERAPIPE_TEST_LOCK=off turns it off.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Iterator

VARIABLE = "TERAPIPE_TEST_LOCK"
YIELD_VARIABLE = "TERAPIPE_TEST_LOCK_YIELD"

_held = 0  # this process's nesting depth: a run inside a held lock does not wait for itself


@contextlib.contextmanager
def one_run_at_a_time() -> Iterator[float]:
    """Hold the machine's lock for a multi-process run; yields the seconds spent waiting."""
    global _held
    path = os.environ.get(VARIABLE, "")
    if not path or path == "off" or _held:
        _held += 1
        try:
            yield 0.0
        finally:
            _held -= 1
        return
    start = time.perf_counter()
    with open(path, "a") as handle, open(path + ".waiting", "a") as waiting:
        _take(handle, waiting, os.environ.get(YIELD_VARIABLE) == "1")
        _held += 1
        try:
            yield time.perf_counter() - start
        finally:
            _held -= 1
            fcntl.flock(handle, fcntl.LOCK_UN)


def _take(handle, waiting, yielding: bool) -> None:
    """Lock `handle`. A session that does not yield holds `waiting` shared while it waits; a
    yielding one takes `waiting` exclusively (so after every waiter) before each try."""
    if not yielding:
        fcntl.flock(waiting, fcntl.LOCK_SH)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        finally:
            fcntl.flock(waiting, fcntl.LOCK_UN)
        return
    while True:
        fcntl.flock(waiting, fcntl.LOCK_EX)  # blocks while another session waits
        fcntl.flock(waiting, fcntl.LOCK_UN)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.05)
