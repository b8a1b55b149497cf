"""Workers that run many cases release each case's process groups (harness.process_groups).

A worker here runs 10 cycles of Megatron's `initialize_model_parallel` (TP=2 on two gloo
processes: 20 groups per cycle, about 50 native threads) and `release_model_parallel`, with an
all-reduce on each cycle's tensor-parallel group and a rotary embedding (whose cached forward
keeps its context-parallel group alive). Without the release (Megatron's
`destroy_model_parallel` alone) the same worker measured 60 threads after the first cycle and
519 after the tenth: 51 more per cycle, 17 groups left each time.
"""

from harness import spawn

CYCLES = 10


def initialize_and_release(rank: int, world_size: int, cycles: int) -> dict:
    """Per cycle: the OS threads and process groups after initialize and after the release,
    the TP all-reduce's result, and the Megatron globals still holding a group."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from harness.process_groups import (holds_group, os_thread_count, release_model_parallel,
                                        subgroups)
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode

    enable_cpu_mode()  # the rotary embedding asks for the current CUDA device

    out: dict = {"initialized": [], "released": [], "groups_left": [], "sums": [],
                 "globals_with_groups": [], "still_initialized": []}
    for _ in range(cycles):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
        value = torch.ones(1) * (rank + 1)
        dist.all_reduce(value, group=parallel_state.get_tensor_model_parallel_group())
        out["sums"].append(float(value))
        rotary = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
                                 cp_group=parallel_state.get_context_parallel_group())
        rotary(16)  # the lru_cache on forward now holds the module and its group
        del rotary
        out["initialized"].append(os_thread_count())
        release_model_parallel()
        out["released"].append(os_thread_count())
        out["groups_left"].append(len(subgroups()))
        out["still_initialized"].append(parallel_state.model_parallel_is_initialized())
        out["globals_with_groups"].append(
            sorted(n for n, v in vars(parallel_state).items() if holds_group(v)))
    return out


def test_repeated_initialize_and_release_keeps_the_thread_count():
    for rank, r in enumerate(spawn(2, "test_process_groups:initialize_and_release", CYCLES,
                                   timeout=300)):
        where = f"rank {rank}: threads after each release {r['released']}"
        assert r["sums"] == [3.0] * CYCLES, r["sums"]  # each cycle's new groups work
        assert r["groups_left"] == [0] * CYCLES, where
        assert not any(r["still_initialized"]), where
        assert r["globals_with_groups"] == [[]] * CYCLES, r["globals_with_groups"]
        # A cycle's groups hold ~50 threads: growth of 4 would be a leak of about one group.
        assert max(r["released"]) - r["released"][0] <= 4, where
        assert max(r["initialized"]) - r["initialized"][0] <= 4, (
            f"rank {rank}: threads after each initialize {r['initialized']}")
        assert max(r["initialized"]) <= 100, r["initialized"]
