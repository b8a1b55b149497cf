import os
import sys
import tempfile

# Tests import the package from the checkout, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The multi-process harness (tests/harness) is imported as `harness`, also by spawned workers.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Multi-process runs of every pytest session on this machine take turns (harness/machine_lock.py):
# .ci/run's 0.19 session runs beside the default run on 2 cores.
os.environ.setdefault("TERAPIPE_TEST_LOCK",
                      os.path.join(tempfile.gettempdir(), "megatron-terapipe-tests.lock"))
# Profiles and auto's calibrations go to a cache of this session's own: a user's cache (or an
# earlier session's calibration) must not change what a test plans.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="megatron-terapipe-cache-")
