"""What one GPT layer keeps for backward with and without sequence parallelism, measured on
CPU with TP ranks on gloo: the peak of autograd's saved tensors (runtime/memory/saved_bytes.py's
SavedTensorMeter) over Megatron's own no-pipelining forward and backward of one microbatch, for
two depths of the same model; their difference is what the extra layers keep."""

from __future__ import annotations

from dataclasses import replace

from ..models import TinyGPT, forward_step, make_batches, seed
from ..process_groups import release_model_parallel


def saved_bytes_per_layer(rank: int, world_size: int, model_cfg: TinyGPT, extra_layers: int,
                          micro_batch_size: int = 1) -> dict[str, float]:
    """Per layer, on this TP rank: the saved-tensor peak of `model_cfg` with `extra_layers`
    more layers, less its own, over `extra_layers`; with and without sequence parallelism."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_terapipe.megatron.model.layer_specs import get_gpt_decoder_block_spec
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode
    from megatron_terapipe.runtime.memory.saved_bytes import SavedTensorMeter

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(world_size, 1)
    batches = make_batches(1, micro_batch_size, model_cfg.seq_length, model_cfg.vocab_size, seed=3)
    per_layer: dict[str, float] = {}
    for sp in (False, True):
        peaks = []
        for layers in (model_cfg.num_layers, model_cfg.num_layers + extra_layers):
            cfg = replace(model_cfg, num_layers=layers, sequence_parallel=sp)
            config = cfg.config(world_size, 1)
            seed(cfg.seed)
            # the block spec: its norms run sequence-parallel on CPU (model/layer_specs.py's TorchNorm)
            model = cfg.build(config, get_gpt_decoder_block_spec(config))
            with SavedTensorMeter(exclude=tuple(model.parameters())) as meter:
                forward_backward_no_pipelining(
                    forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                    num_microbatches=1, seq_length=cfg.seq_length,
                    micro_batch_size=micro_batch_size)
            peaks.append(meter.peak_bytes)
        per_layer["sequence_parallel" if sp else "replicated"] = (peaks[1] - peaks[0]) / extra_layers
    release_model_parallel()
    return per_layer
