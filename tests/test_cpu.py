"""CPU helpers: binding single-threaded ranks to their own cores."""

import os

import pytest

from megatron_terapipe import pin_to_core
from megatron_terapipe.testing import spawn


def test_pin_to_core_binds_each_rank_to_its_own_core():
    assert pin_to_core(0, 10**6) is None  # fewer cores than ranks: nothing is pinned
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    (core0, aff0), (core1, aff1) = spawn(2, "megatron_terapipe.testing:pinned_core")
    assert core0 != core1
    # every thread, gloo's workers included (a process group exists: several threads)
    assert len(aff0) > 1 and all(a == [core0] for a in aff0)
    assert len(aff1) > 1 and all(a == [core1] for a in aff1)
