"""CPU helpers: binding single-threaded ranks to their own cores."""

import os

import pytest

from megatron_terapipe import pin_to_core
from harness import spawn


def test_pin_to_core_binds_each_rank_to_its_own_core():
    assert pin_to_core(0, 10**6) is None  # fewer cores than ranks: nothing is pinned
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    (core0, aff0), (core1, aff1) = spawn(2, "harness:pinned_core")
    assert core0 != core1
    # every thread, gloo's workers included (a process group exists: several threads)
    assert len(aff0) > 1 and all(a == [core0] for a in aff0)
    assert len(aff1) > 1 and all(a == [core1] for a in aff1)


_FAULTS_SCRIPT = """
import resource, sys, torch
from megatron_terapipe.megatron.cpu import keep_freed_host_memory
changed = keep_freed_host_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def iteration():  # an iteration's activations: 8 tensors of 16 MiB, freed at its end
    xs = [torch.ones(4 << 20) for _ in range(8)]
    del xs
iteration()
before = faults()
for _ in range(5):
    iteration()
print(changed, faults() - before)
"""


def _faults(mode: str, env: dict) -> tuple[str, int]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux page-fault counts")
def test_keep_freed_host_memory_stops_page_faults_of_repeated_tensors():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    _, default_faults = _faults("default", env)
    changed, kept_faults = _faults("keep", env)
    if changed != "True":
        pytest.skip("not glibc")
    # 5 iterations of 8 tensors of 16 MiB (4096 pages each). By default glibc hands the memory
    # back at the end of an iteration and faults it in again in the next: measured 9 to all 40
    # tensors' pages. Kept, measured 1 tensor's (4096 pages); at most 2 are allowed.
    pages = 5 * 8 * 4096
    assert default_faults >= pages // 8, default_faults
    assert kept_faults <= pages // 20, kept_faults
    # a user's own allocator tuning is left alone
    changed, _ = _faults("keep", dict(env, MALLOC_TRIM_THRESHOLD_="1000000"))
    assert changed == "False"
