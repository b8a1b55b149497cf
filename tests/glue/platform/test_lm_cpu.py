"""CPU route for Megatron-LM's training script (megatron/platform/lm_cpu.py): the pieces that run
without a Megatron-LM checkout (tests/glue/test_megatron_lm.py runs the real script when one
is given)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_terapipe.megatron.platform import compat, lm_cpu
from megatron_terapipe.megatron.platform.cpu_mode import cpu_model_parallel_seed


def test_seed_takes_megatron_lm_positional_arguments():
    # initialize._set_random_seed: model_parallel_cuda_manual_seed(seed, te, inference, graphable)
    cpu_model_parallel_seed(7, False, False, False)
    a = torch.rand(3)
    cpu_model_parallel_seed(7, True, True, True)
    assert torch.equal(a, torch.rand(3))


def test_training_modules_see_one_cpu_device():
    cuda = lm_cpu._torch_with_cpu_cuda().cuda
    assert cuda.is_available() and cuda.device_count() == 1
    assert cuda.current_device() == torch.device("cpu")
    stream = cuda.Stream()
    stream.wait_stream(cuda.current_stream())
    with cuda.stream(stream):
        pass
    state = torch.get_rng_state()
    assert torch.equal(cuda.get_rng_state(), state)


def _args(**kw):
    base = dict(clip_grad=0.0, distributed_backend="nccl", transformer_impl="transformer_engine",
                gradient_accumulation_fusion=True, no_persist_layer_norm=False,
                masked_softmax_fusion=True, bias_gelu_fusion=True, bias_swiglu_fusion=True,
                bias_dropout_fusion=True)
    base.update(kw)
    return SimpleNamespace(**base)


def test_cpu_settings_are_applied_and_logged():
    args = _args()
    lines = lm_cpu.apply_cpu_settings(args)
    for name, value in lm_cpu.CPU_SETTINGS.items():
        assert getattr(args, name) == value
    assert "> terapipe cpu: distributed_backend 'nccl' -> 'gloo'" in lines
    assert lm_cpu.apply_cpu_settings(args) == []  # nothing left to change


def test_gradient_clipping_is_left_as_the_user_set_it():
    """Clipping runs on CPU (CPU mode wraps clip_grad_by_total_norm_fp32): nothing to refuse or
    change (tests/equivalence/test_distributed_optimizer.py clips; the Megatron-LM matrix runs
    with 1.0)."""
    args = _args(clip_grad=1.0)
    assert not any("clip" in line for line in lm_cpu.apply_cpu_settings(args))
    assert args.clip_grad == 1.0


def test_save_without_psutil_is_refused_before_training(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "psutil" else find_spec(name, *a))
    with pytest.raises(ValueError, match="--save ckpt: .*pip install psutil"):
        lm_cpu.apply_cpu_settings(_args(save="ckpt", ckpt_format="torch_dist"))
    lm_cpu.apply_cpu_settings(_args())  # without --save nothing is asked for


class _Tracker:
    def __init__(self, states):
        self.states = states

    def get_states(self):
        return dict(self.states)

    def set_states(self, states):
        self.states = states


def test_checkpoints_see_a_marked_cpu_tracker_and_loading_drops_the_mark():
    from megatron.core import tensor_parallel

    empty = lm_cpu._CheckpointedCpuTracker(_Tracker({}))
    saved = empty.get_states()
    assert list(saved) == [lm_cpu.CPU_TRACKER_MARK]  # Megatron-LM refuses to load {}
    # what Megatron-LM's load does with each saved state before set_states
    loaded = {k: tensor_parallel.convert_cuda_rng_state(v, to_graphable=False)
              for k, v in saved.items()}
    empty.set_states(loaded)
    assert empty._tracker.states == {}
    holding = lm_cpu._CheckpointedCpuTracker(_Tracker({"model-parallel-rng": torch.ones(2)}))
    assert list(holding.get_states()) == ["model-parallel-rng"]  # real states are kept as they are
    seen = lm_cpu._TensorParallelForCheckpoints(tensor_parallel)
    assert seen.convert_cuda_rng_state is tensor_parallel.convert_cuda_rng_state
    kept = compat.save_rng_tracker()  # getting the tracker may create the global one
    try:
        assert isinstance(seen.get_cuda_rng_tracker(), lm_cpu._CheckpointedCpuTracker)
    finally:
        compat.restore_rng_tracker(kept)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_process_groups_and_their_threads_go_before_interpreter_exit():
    """A gloo group alive at interpreter exit can abort the process ('terminate called without
    an active exception'); the launcher releases every group after a CPU run, even those held
    in reference cycles, and their worker threads end with them."""
    from harness.spawn import spawn

    for before, after in spawn(2, "harness.process_groups:gloo_threads_around_release_at_exit"):
        assert before >= 2 * 4  # the default group and Megatron's, two threads each
        assert after == 0


@pytest.mark.parametrize("end, released", [
    (lambda: None, True), (lambda: sys.exit(0), True), (lambda: sys.exit(), True),
    (lambda: sys.exit(1), False), (lambda: (_ for _ in ()).throw(RuntimeError("x")), False)])
def test_the_launcher_releases_the_groups_after_a_clean_end_only(monkeypatch, end, released):
    """A return or a clean sys.exit (Megatron-LM's --exit-interval) releases the process groups
    on CPU; a failed rank does not tear down (its peers may be inside a collective)."""
    from megatron_terapipe.megatron import launch

    calls = []
    monkeypatch.setattr(launch, "install_hooks", lambda: None)
    monkeypatch.setattr(launch, "_enable_cpu_if_asked", lambda args: None)
    monkeypatch.setattr(lm_cpu, "release_process_groups", lambda: calls.append(1))
    try:
        launch._run(["--terapipe-cpu"], end)
    except (SystemExit, RuntimeError):
        pass
    assert calls == ([1] if released else [])
    launch._run([], lambda: None)  # not on CPU: nothing to release
    assert calls == ([1] if released else [])
