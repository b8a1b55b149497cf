import os
import tempfile

# The package, `harness` and the benchmarks' modules are importable through pyproject.toml's
# `pythonpath` (spawned workers get the same import path).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Multi-process runs of every pytest session on this machine take turns (harness/machine_lock.py):
# .ci/run's 0.19 session runs beside the default run on 2 cores.
os.environ.setdefault("TERAPIPE_TEST_LOCK",
                      os.path.join(tempfile.gettempdir(), "megatron-terapipe-tests.lock"))
# Profiles and auto's calibrations go to a cache of this session's own: a user's cache (or an
# earlier session's calibration) must not change what a test plans.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="megatron-terapipe-cache-")
