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
from megatron_terapipe.megatron.platform.cpu_mode import keep_freed_host_memory
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


_CPU_MODE_ROUND_TRIP = """
import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import random as tp_random
from megatron_terapipe.megatron.platform import compat
from megatron_terapipe.megatron.platform import cpu_mode as cpu

def names():
    owners = [(torch.cuda, "current_device"), (torch.cuda, "synchronize"),
              *([] if torch.cuda.is_available() else [(torch.Tensor, "cuda")]),  # CUDA: kept
              (tp_random, "model_parallel_cuda_manual_seed"), (tp_random, "_get_cuda_rng_state"),
              (tp_random, "_set_cuda_rng_state"),
              (tensor_parallel, "model_parallel_cuda_manual_seed")]
    owners += [(m, "torch") for m in compat.cpu_mode_modules()]
    return [getattr(owner, name) for owner, name in owners]

before = names()
cpu.enable_cpu_mode()
during = names()
assert str(torch.cuda.current_device()) == "cpu"
assert all(a is not b for a, b in zip(before, during)), "enable_cpu_mode patched them all"
cpu.enable_cpu_mode()  # idempotent: nothing patched twice
cpu.disable_cpu_mode()
assert all(a is b for a, b in zip(before, names())), "every original is back"
cpu.disable_cpu_mode()  # idempotent
assert all(a is b for a, b in zip(before, names()))
cpu.enable_cpu_mode()  # and it can be switched on again
assert str(torch.cuda.current_device()) == "cpu"
print("ok")
"""


def test_disable_cpu_mode_restores_every_patched_name():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _CPU_MODE_ROUND_TRIP],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
