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
    assert core0 != core1 and aff0 == [core0] and aff1 == [core1]
