"""The measurement clocks: wall time with the device synchronised, or the GPU's own time with
the host's launches queued behind a sleep (measure/clocks.py). The device clock runs here on a
stand-in CUDA module whose events say when the GPU passed them; on a GPU, gpu_session.sh's
`measure` part runs it for real."""

import pytest

from megatron_terapipe.megatron.measure.clocks import (DeviceClock, HoldTooShort, WallClock,
                                                       make_clock, timed)


class _FakeCuda:
    """The GPU's timeline as a list: `_sleep` adds a hold, each event its time; `host_slow`
    says whether the host finished queueing after the hold ended (the start event then ran)."""

    def __init__(self, host_slow_tries: int = 0):
        self.host_slow_tries = host_slow_tries  # regions in a row the host queues too slowly
        self.slept, self.syncs, self.clock_ms = [], 0, 0.0

    def is_available(self):
        return True

    def synchronize(self):
        self.syncs += 1

    def _sleep(self, cycles):
        self.slept.append(cycles)

    def Event(self, enable_timing):  # noqa: N802 - torch.cuda's name
        cuda = self

        class _Event:
            def __init__(self):
                cuda.clock_ms += 1.5  # every region part takes 1.5 ms of GPU time
                self.at = cuda.clock_ms

            def record(self):
                pass

            def query(self):  # the start event: done already if the host was too slow
                slow = cuda.host_slow_tries > 0
                cuda.host_slow_tries -= 1
                return slow

            def elapsed_time(self, other):
                return other.at - self.at

        return _Event()


def test_device_clock_times_gpu_spans_and_doubles_a_short_hold():
    cuda = _FakeCuda(host_slow_tries=2)
    # the host's queueing takes no time here: the holds are the doubling's alone (with the
    # real clock, a loaded CI machine took over 1 ms to queue and sized a longer hold, 3112)
    clock = DeviceClock(cuda, hold_cycles=1000, now=lambda: 0.0)
    calls = []

    def region():
        calls.append(1)
        clock.begin()
        clock.mark()
        clock.mark()
        return clock.spans()

    spans = clock.retried(region)
    assert spans == [pytest.approx(1.5e-3), pytest.approx(1.5e-3)]
    assert len(calls) == 3 and cuda.slept == [1000, 2000, 4000]  # two short holds, doubled


def _region(clock):
    clock.begin()
    clock.mark()
    return clock.spans()


def test_device_clock_sizes_each_hold_from_the_last_region_and_shrinks_it_back():
    # a hold that only grew (doubling on every short one, for good) made a GPU profile take
    # about 3 s a cell; now each region's hold is twice the last queueing time in the sleep's
    # own cycles per second (1000 cycles took 1.5 ms of GPU time here), never under the first
    times = iter([0.0, 0.006, 1.0, 1.0, 2.0, 2.0])
    cuda = _FakeCuda()
    clock = DeviceClock(cuda, hold_cycles=1000, now=lambda: next(times))
    for _ in range(3):
        assert clock.retried(lambda: _region(clock)) == [pytest.approx(1.5e-3)]
    # 6 ms of queueing at 1000 / 1.5e-3 cycles per second, twice: 8000 cycles; then back to 1000
    assert cuda.slept == [1000, 8000, 1000]
    assert clock.summary() == {"regions": 3, "reruns": 0, "largest_hold_cycles": 8000,
                               "first_hold_cycles": 1000}


def test_after_short_holds_the_next_region_starts_from_the_first_hold_again():
    cuda = _FakeCuda(host_slow_tries=3)
    clock = DeviceClock(cuda, hold_cycles=1000, now=lambda: 0.0)
    clock.retried(lambda: _region(clock))
    clock.retried(lambda: _region(clock))
    assert cuda.slept == [1000, 2000, 4000, 8000, 1000]
    assert clock.summary()["reruns"] == 3 and clock.summary()["largest_hold_cycles"] == 8000


def test_device_clock_gives_up_with_the_option_named():
    clock = DeviceClock(_FakeCuda(host_slow_tries=99), hold_cycles=10, tries=3)
    with pytest.raises(RuntimeError, match="--timing wall"):
        clock.retried(lambda: timed(clock, lambda: None))


def test_a_short_hold_raises_for_the_caller_to_rerun_the_whole_region():
    clock = DeviceClock(_FakeCuda(host_slow_tries=1), hold_cycles=10)
    with pytest.raises(HoldTooShort):
        timed(clock, lambda: None)


def test_device_timing_is_refused_off_a_gpu_before_any_measuring():
    with pytest.raises(ValueError, match="--timing device measures GPU time.*--timing wall"):
        make_clock("device", lambda: None, on_gpu=False)
    with pytest.raises(ValueError, match="timing must be one of wall, device"):
        make_clock("gpu", lambda: None, on_gpu=True)


def test_layer_measurement_checks_timing_before_any_work():
    from megatron_terapipe.megatron.measure.layers import measure_layer_times
    from megatron_terapipe.planner.cost.dims import ModelDims

    model = ModelDims(num_layers=1, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="timing must be one of"):
        measure_layer_times(model, [(1, 8, 0)], timing="cuda", edges=False, progress=False)


def test_wall_clock_synchronises_at_every_mark():
    syncs = []
    clock = WallClock(lambda: syncs.append(1))
    seconds, out = timed(clock, lambda: "done")
    assert out == "done" and seconds >= 0 and len(syncs) == 2


def test_the_command_refuses_device_timing_without_cuda(capsys):
    import torch

    from megatron_terapipe.megatron.measure.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --timing device runs here")
    with pytest.raises(SystemExit):
        main(["layers", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
              "128", "--timing", "device", "--out", "unused.json"])
    assert "--timing device measures GPU time" in capsys.readouterr().err


class _OnceShortClock(WallClock):
    """A wall clock whose first region of each retried call is reported too short, as a device
    clock does when the host was slow: the region must run again from fresh inputs."""

    def __init__(self, sync):
        super().__init__(sync)
        self.short_next, self.regions = True, 0

    def spans(self):
        if self.short_next:
            self.short_next = False
            raise HoldTooShort
        return super().spans()

    def retried(self, region):
        self.short_next = True
        for _ in range(2):
            try:
                self.regions += 1
                return region()
            except HoldTooShort:
                continue
        raise AssertionError("the region did not finish on its second try")


def test_a_rerun_region_measures_a_layer_and_the_edges_again_from_scratch():
    # the deferred cell's rerun gets a fresh weight-gradient store (it counts what it received:
    # a reused one would fail the check that every deferrable parameter deferred)
    import math

    from megatron_terapipe.megatron.measure.device_setup import MeasureDevice
    from megatron_terapipe.megatron.measure.edges import _EdgeParts
    from megatron_terapipe.megatron.measure.layers import _SliceLayer
    from megatron_terapipe.planner.cost.dims import ModelDims

    env = MeasureDevice("float32", "cpu", 0)
    model = ModelDims(num_layers=1, hidden_size=64, num_attention_heads=4)
    clock = _OnceShortClock(env.sync)
    times = _SliceLayer(env, model, clock).run(1, 16, 0)
    assert clock.regions == 4 and all(math.isfinite(t) and t > 0 for t in times)
    clock = _OnceShortClock(env.sync)
    edges = _EdgeParts(env, model, 128, 32, "learned_absolute", 0, clock).run(1, 16)
    assert clock.regions == 2 and all(t > 0 for t in edges)


def test_a_device_profile_records_and_prints_what_its_holds_did():
    from megatron_terapipe.megatron.measure.clocks import clock_metadata
    from megatron_terapipe.megatron.measure.layers import measure_layer_times, summary_lines
    from megatron_terapipe.planner.cost.dims import ModelDims
    from megatron_terapipe.planner.profile.least_squares import fit_layer_times

    clock = DeviceClock(_FakeCuda(host_slow_tries=1), hold_cycles=1000, now=lambda: 0.0)
    clock.retried(lambda: _region(clock))
    assert clock_metadata(WallClock(lambda: None)) == {}
    assert clock_metadata(clock) == {"device_clock": {"regions": 2, "reruns": 1,
                                                      "largest_hold_cycles": 2000,
                                                      "first_hold_cycles": 1000}}
    model = ModelDims(num_layers=1, hidden_size=64, num_attention_heads=4)
    measured = measure_layer_times(model, seq_length=64, granularity=16, edges=False,
                                   progress=False, dtype="float32", device="cpu", repeats=1)
    assert "device_clock" not in measured.metadata  # wall-timed
    measured.metadata.update(clock_metadata(clock))
    lines = summary_lines(fit_layer_times(measured), measured)
    assert "device clock: 2 timed regions, 1 rerun after a short hold, largest hold 2000 GPU cycles" in lines
