"""The benchmark's host-staged P2PCommunicator (benchmarks/host_staged.py) on 2 gloo processes.

On CPU tensors its staging is a no-op, so what this checks is the communicator itself: Megatron's
unmodified 1F1B and the TeraPipe schedule, given it through `p2p_communicator=`, produce the same
losses and gradients, bit for bit, as with their default transports (same arithmetic, only the
transfers differ), and every transfer went through it.
"""

from __future__ import annotations

import pytest
import torch

from harness import spawn


def run_both_transports(rank: int, world_size: int) -> dict:
    from host_staged import HostStagedP2PCommunicator
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    from harness import (TinyGPT, build_stage_model, forward_step, make_batches,
                         release_model_parallel)
    from harness.compare import chunk_grads
    from megatron_terapipe import (TeraPipeConfig, TeraPipePlan, enable_cpu_mode,
                                   forward_backward_terapipe)

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    model_cfg = TinyGPT(num_layers=2, seq_length=16)
    config, model = build_stage_model(model_cfg, 1, world_size)
    batches = make_batches(3, 2, model_cfg.seq_length, model_cfg.vocab_size, seed=5)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    common = dict(forward_step_func=forward_step, model=[model], num_microbatches=len(batches),
                  seq_length=model_cfg.seq_length, micro_batch_size=2)
    runs = {}
    for name, schedule, extra in (
            ("megatron_default", forward_backward_pipelining_without_interleaving, {}),
            ("megatron_staged", forward_backward_pipelining_without_interleaving, {"staged": True}),
            ("terapipe_default", forward_backward_terapipe, {"plan": TeraPipePlan([8, 8])}),
            ("terapipe_staged", forward_backward_terapipe, {"plan": TeraPipePlan([8, 8]), "staged": True})):
        model.zero_grad(set_to_none=True)
        kwargs = {k: v for k, v in extra.items() if k != "staged"}
        communicator = None
        if extra.get("staged"):
            communicator = HostStagedP2PCommunicator(pp_group, config)
            kwargs["p2p_communicator"] = communicator
            # Megatron takes a communicator only together with every process group.
            kwargs["pg_collection"] = ProcessGroupCollection.use_mpu_process_groups()
            config.terapipe = TeraPipeConfig(transport="megatron")  # TeraPipe's transport over it
        losses = schedule(data_iterator=iter(batches), **common, **kwargs)
        config.terapipe = TeraPipeConfig()
        grads = {n: g for n, g in chunk_grads([model]).items() if g is not None}
        runs[name] = {"losses": [float(l["lm loss"][0]) for l in losses], "grads": grads,
                      "transfers": communicator.transfers if communicator else None}
    release_model_parallel()
    return runs


@pytest.mark.slow
def test_host_staged_communicator_matches_the_default_transports():
    for runs in spawn(2, "test_host_staged:run_both_transports", timeout=300):
        for schedule in ("megatron", "terapipe"):
            default, staged = runs[f"{schedule}_default"], runs[f"{schedule}_staged"]
            assert staged["transfers"] > 0
            assert staged["losses"] == default["losses"]
            assert staged["grads"].keys() == default["grads"].keys()
            for name, grad in default["grads"].items():
                assert torch.equal(staged["grads"][name], grad), name
