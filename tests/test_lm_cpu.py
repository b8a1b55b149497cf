"""CPU route for Megatron-LM's training script (megatron/hooks/lm_cpu.py): the pieces that run
without a Megatron-LM checkout (tests/test_megatron_lm.py runs the real script when one is given)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_terapipe.megatron.hooks import lm_cpu
from megatron_terapipe.megatron.hooks.cpu import cpu_model_parallel_seed


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


def test_gradient_clipping_must_be_turned_off_by_the_user():
    with pytest.raises(ValueError, match="pass --clip-grad 0.0"):
        lm_cpu.apply_cpu_settings(_args(clip_grad=1.0))
