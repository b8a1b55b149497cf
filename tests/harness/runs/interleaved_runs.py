"""Megatron's own interleaved 1F1B on CPU, recorded: what each rank computes and what each of
its communication calls sends and receives, to check schedule/interleaved.py against it."""

from __future__ import annotations

from ..models import TinyGPT, forward_step, make_batches
from ..process_groups import release_model_parallel
from ..measured.schedule_runs import interleaved_model


def record_interleaved_calls(rank: int, world_size: int, model_cfg: TinyGPT,
                             num_microbatches: int, chunks: int,
                             forward_only: bool = False) -> list[tuple]:
    """One iteration of forward_backward_pipelining_with_interleaving. Returns this rank's
    events in order: ("F", chunk) per forward step, ("P2P", send_next, send_prev, recv_prev,
    recv_next) per P2PCommunicator._communicate call."""
    from unittest import mock

    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving)

    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    config, model = interleaved_model(model_cfg, world_size, chunks)
    events: list[tuple] = []
    communicate = p2p_communication.P2PCommunicator._communicate

    def recorded(self, **kw):
        events.append(("P2P", kw["tensor_send_next"] is not None,
                       kw["tensor_send_prev"] is not None, bool(kw["recv_prev"]),
                       bool(kw["recv_next"])))
        return communicate(self, **kw)

    def step(data_iterator, module):
        events.append(("F", next(c for c, m in enumerate(model) if m is module)))
        return forward_step(data_iterator, module)

    batches = make_batches(num_microbatches, 1, model_cfg.seq_length, model_cfg.vocab_size)
    with mock.patch.object(p2p_communication.P2PCommunicator, "_communicate", recorded):
        forward_backward_pipelining_with_interleaving(
            forward_step_func=step, data_iterator=[iter(batches) for _ in model], model=model,
            num_microbatches=num_microbatches, seq_length=model_cfg.seq_length,
            micro_batch_size=1, forward_only=forward_only)
    release_model_parallel()
    return events
