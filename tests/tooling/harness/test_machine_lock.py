"""Multi-process runs of concurrent pytest sessions take turns (harness/machine_lock.py)."""

import glob
import os
import subprocess
import sys
import time

from harness.machine_lock import one_run_at_a_time
from harness.paths import TESTS

# Another process's run: it loads machine_lock.py by its path (no torch), reports how long it
# waited for the lock and when it got it, then holds it for the given seconds.
_OTHER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("machine_lock", sys.argv[1])
lock = importlib.util.module_from_spec(spec); spec.loader.exec_module(lock)
with lock.one_run_at_a_time() as waited:
    print(f"{waited:.3f} {time.time():.3f}", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _waited(line):
    return float(line.split()[0])


def _acquired_at(line):
    return float(line.split()[1])


def _other(hold, lock_file, yielding=False):
    env = dict(os.environ, TERAPIPE_TEST_LOCK=lock_file, TERAPIPE_TEST_LOCK_YIELD=str(int(yielding)))
    script = os.path.join(TESTS, "harness", "machine_lock.py")
    return subprocess.Popen([sys.executable, "-c", _OTHER, script, str(hold)], env=env,
                            stdout=subprocess.PIPE, text=True)


def test_a_second_session_waits_until_the_first_run_ends(tmp_path, monkeypatch):
    lock_file = str(tmp_path / "lock")
    monkeypatch.setenv("TERAPIPE_TEST_LOCK", lock_file)
    # Clock times, not durations: under load a process may start late and wait less.
    with one_run_at_a_time() as waited:
        assert waited < 0.5
        other = _other(0, lock_file)
        time.sleep(1.0)
        with one_run_at_a_time() as nested:  # this process's own nested run does not wait
            assert nested == 0.0
        released = time.time()
    line = other.communicate(timeout=30)[0]
    assert _acquired_at(line) >= released - 0.01 and _waited(line) > 0  # after this run
    # and the other way round: this process waits for another's run (it holds it 1 s)
    other = _other(1.0, lock_file)
    taken = _acquired_at(other.stdout.readline())
    with one_run_at_a_time() as waited:
        assert time.time() >= taken + 1.0 - 0.01 and waited > 0
    other.wait(timeout=30)


def test_a_yielding_session_lets_a_waiting_one_go_first(tmp_path, monkeypatch):
    lock_file = str(tmp_path / "lock")
    monkeypatch.setenv("TERAPIPE_TEST_LOCK", lock_file)
    monkeypatch.delenv("TERAPIPE_TEST_LOCK_YIELD", raising=False)
    holder = _other(1.5, lock_file)
    taken = _acquired_at(holder.stdout.readline())
    yielding = _other(0, lock_file, yielding=True)  # asks first ...
    time.sleep(0.5)
    with one_run_at_a_time() as waited:  # ... but this session, asking later, goes first
        acquired = time.time()
        time.sleep(0.5)
    released = time.time()
    assert acquired >= taken + 1.5 - 0.01 and waited > 0  # after the holder's run
    got = float(yielding.communicate(timeout=30)[0].split()[1])
    assert got >= released - 0.01
    holder.wait(timeout=30)


def test_off_takes_no_lock(tmp_path, monkeypatch):
    lock_file = str(tmp_path / "lock")
    other = _other(2.0, lock_file)
    assert _waited(other.stdout.readline()) < 0.5
    monkeypatch.setenv("TERAPIPE_TEST_LOCK", "off")
    with one_run_at_a_time() as waited:
        assert waited == 0.0
    other.wait(timeout=30)


def test_every_torchrun_of_the_tests_takes_the_lock():
    """spawn() takes it for 2 or more ranks; the tests that start torchrun themselves must too."""
    files = glob.glob(os.path.join(TESTS, "**", "*.py"), recursive=True)  # harness/ too
    starters = [f for f in files if "torch.distributed.run" in open(f).read() and f != __file__]
    assert len(starters) >= 3  # test_launch.py, test_examples.py, harness/megatron_lm.py
    missing = [os.path.basename(f) for f in starters if "one_run_at_a_time()" not in open(f).read()]
    assert missing == []
