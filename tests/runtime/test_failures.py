"""A rank that raises inside the schedule must not leave its peers waiting forever."""

import time

import pytest

from harness import WorkerError, spawn

SCENARIOS = [
    (2, 1, "forward"), (2, 1, "loss"), (2, 0, "backward"), (2, 1, "wgrad"),
    (4, 2, "forward"),  # a middle rank: the error travels both ways
]
#: The same places on 4 processes repeat the 2-process property (marked slow: .ci/run runs them).
SLOW_SCENARIOS = [(4, 3, "loss"), (4, 1, "backward"), (4, 2, "wgrad")]


@pytest.mark.parametrize("world, fail_rank, where", SCENARIOS + [
    pytest.param(*s, marks=pytest.mark.slow) for s in SLOW_SCENARIOS],
    ids=[f"{w}proc-rank{r}-{where}" for w, r, where in SCENARIOS + SLOW_SCENARIOS])
def test_every_rank_exits_with_an_error(world, fail_rank, where):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(world, "harness:run_with_failure", fail_rank, where,
              timeout=120, grace=45)
    elapsed = time.monotonic() - start
    err = info.value
    assert f"injected failure in {where if where != 'forward' else 'forward_step'}" in err.reports[fail_rank]
    # Every peer that was still waiting ended with its own error; none had to be killed.
    assert err.killed == []
    assert elapsed < 60, f"took {elapsed:.0f} s"
