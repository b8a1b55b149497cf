"""config.deallocate_pipeline_outputs: a stage output's data is freed once it is sent.

As in Megatron's schedules, only the output's grad_fn is needed afterwards (the backward starts
from it through the autograd engine). The equivalence cases "*_deallocate_outputs" check that
losses and gradients stay equal to Megatron's no-pipelining run; here: the storage really goes.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from harness import spawn
from megatron_terapipe import TeraPipePlan, build_schedule
from megatron_terapipe.runtime.batching import CellData
from megatron_terapipe.runtime.executor import StageExecutor, StageModel, StageOptions
from megatron_terapipe.runtime.comm.transport import Transport

HIDDEN, ROWS, SEQ = 8, 2, 8


class SendsThenGradients(Transport):
    """Stage 0 of two, the neighbour played here: each send completes at once (nothing keeps
    the tensor), each gradient is ones. At every gradient receive it notes whether the storage
    of every output sent so far is gone."""

    def __init__(self) -> None:
        self.sent: list[weakref.ref] = []
        self.all_freed_at_receive: list[bool] = []

    def send(self, direction, tensor):
        assert direction == "F"
        self.sent.append(weakref.ref(tensor.untyped_storage()))

    def recv(self, direction, shape):
        assert direction == "B"
        self.all_freed_at_receive.append(all(ref() is None for ref in self.sent))
        return torch.ones(shape)


def _run_first_stage(deallocate: bool, output_is_view: bool = False):
    torch.manual_seed(0)
    module = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward_step(data_iterator, model):
        x = next(data_iterator)["x"].transpose(0, 1)  # [tokens, rows, hidden]
        output = model(x)
        return (output[:] if output_is_view else output * 2.0), None

    batches = [{"x": torch.randn(ROWS, SEQ, HIDDEN)} for _ in range(2)]
    schedule = build_schedule(TeraPipePlan([3, 5]), 2, 2, ROWS)
    transport = SendsThenGradients()
    executor = StageExecutor(
        schedule, 0, StageModel(module, forward_step, set_input_tensor=lambda inputs: None),
        CellData(iter(batches), SEQ, ROWS), transport,
        StageOptions(hidden_size=HIDDEN, deallocate_outputs=deallocate), torch.device("cpu"))
    executor.run()
    return module.weight.grad.clone(), transport, executor.record


def test_a_sent_output_is_freed_before_its_gradient_arrives():
    grad, transport, record = _run_first_stage(deallocate=True)
    assert record.outputs_deallocated == 4  # 2 microbatches x 2 token slices
    assert transport.all_freed_at_receive == [True] * 4
    # the backward from the freed outputs computes the same gradient
    kept_grad, kept, _ = _run_first_stage(deallocate=False)
    assert kept.all_freed_at_receive[-1] is False  # without the option the outputs stay
    torch.testing.assert_close(grad, kept_grad, rtol=0, atol=0)


def test_a_view_cannot_be_freed():
    with pytest.raises(ValueError, match="view of another tensor"):
        _run_first_stage(deallocate=True, output_is_view=True)


def storage_freed_at_backward(rank: int, world_size: int) -> tuple[list[bool], int]:
    """A Megatron GPT stage over gloo: for every output a non-last stage sent, whether its
    storage was gone when its backward began, and how many outputs the executor freed."""
    from megatron.core import parallel_state

    from harness import (TinyGPT, build_stage_model, forward_step, make_batches,
                         release_model_parallel)
    from megatron_terapipe import enable_cpu_mode, forward_backward_terapipe

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    model_cfg = TinyGPT()
    config, model = build_stage_model(model_cfg, 1, world_size)
    config.deallocate_pipeline_outputs = True
    freed: list[bool] = []

    def step(data_iterator, model):
        output, loss = forward_step(data_iterator, model)
        if not parallel_state.is_pipeline_last_stage():
            storage = weakref.ref(output.untyped_storage())
            output.register_hook(lambda grad: freed.append(storage() is None))
        return output, loss

    records: list = []
    forward_backward_terapipe(
        forward_step_func=step, model=[model], num_microbatches=3,
        data_iterator=iter(make_batches(3, 2, model_cfg.seq_length, model_cfg.vocab_size)),
        seq_length=model_cfg.seq_length, micro_batch_size=2, plan=TeraPipePlan([5, 7, 4]),
        on_run=records.append)
    release_model_parallel()
    return freed, records[-1].outputs_deallocated


def test_megatron_stage_outputs_leave_memory_once_sent():
    first, last = spawn(2, "test_deallocation:storage_freed_at_backward", timeout=300)
    assert first == ([True] * 9, 9)  # 3 microbatches x 3 token slices
    assert last == ([], 0)  # the last stage sends no outputs
