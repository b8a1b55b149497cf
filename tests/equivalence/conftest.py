"""The worlds of the equivalence runs: a test module's cases run once per module on 2 and on 4
gloo processes (harness.spawn), and its tests check each case in every rank's results.

A module that takes `world2` / `world4` names what runs: WORKER, the worker ("module:function")
that runs a list of cases on every rank; WORLDS, the cases of each world size (e.g.
{2: CASES_2, 4: CASES_4}); and, where its runs need another limit than 900 s, WORLD_TIMEOUT."""

import pytest

from harness import spawn


def _world(module, size: int) -> list:
    return spawn(size, module.WORKER, module.WORLDS[size],
                 timeout=getattr(module, "WORLD_TIMEOUT", 900))


@pytest.fixture(scope="module")
def world2(request):
    """Every rank's results of the module's cases on 2 processes."""
    return _world(request.module, 2)


@pytest.fixture(scope="module")
def world4(request):
    """Every rank's results of the module's cases on 4 processes."""
    return _world(request.module, 4)
