"""Timed pipeline runs shared by the schedule benchmarks: Megatron's 1F1B and TeraPipe plans on
the same stage models, interleaved round by round, plus the plans and predictions to compare.

`speed_worker` runs on every stage process (harness.spawn). A `SpeedCase` says what to run:
- on CPU: gloo, one core per stage (`pin_to_core`);
- on one GPU shared by the stages (`mps=True`): each process takes its SM share under CUDA MPS
  (mps.enter_stage) and both schedules move activations through host memory
  (host_staged.HostStagedP2PCommunicator, given to Megatron's 1F1B and to TeraPipe alike);
- on one GPU per stage: Megatron's own transfers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from harness import TinyGPT
from megatron_terapipe.plan import TeraPipePlan


@dataclass
class SpeedCase:
    name: str
    model: TinyGPT
    num_microbatches: int
    granularity: int
    repeats: int
    plans: dict = field(default_factory=dict)  # label -> TeraPipePlan (None: Megatron 1F1B)
    mps: bool = False  # stages share one GPU under CUDA MPS, transfers staged through the host
    cuda_graphs: bool = False  # TeraPipe replays a graph per compute action (CPU: ReplayGraph)


def _stage_setup(rank: int, world_size: int, case: SpeedCase, device: str):
    """This stage's model, batches and the communicator both schedules use (None: default)."""
    from megatron.core import parallel_state

    from harness import build_stage_model, make_batches, to_device

    if case.mps:
        from mps import enter_stage

        enter_stage(rank, world_size)
    if device == "cpu":
        from megatron_terapipe.megatron.hooks.cpu import enable_cpu_mode, pin_to_core

        enable_cpu_mode()
        pin_to_core(rank, world_size)  # one core per stage, as one GPU per rank on GPUs
    parallel_state.initialize_model_parallel(1, world_size)
    config, model = build_stage_model(case.model, 1, world_size)
    model = to_device(model, device)
    communicator = None
    if case.mps:
        from host_staged import HostStagedP2PCommunicator

        communicator = HostStagedP2PCommunicator(
            parallel_state.get_pipeline_model_parallel_group(), config)
        config.terapipe_transport = "megatron"  # TeraPipe's transport over the same communicator
    batches = [{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
               for b in make_batches(case.num_microbatches, 1, case.model.seq_length,
                                     case.model.vocab_size, masked_rows=False)]
    return config, model, batches, communicator


def _warm_up(label: str, run, model, case: SpeedCase, device: str, times: dict) -> None:
    """Allocator, kernels, connections (with graphs: the capture too); then the peak memory."""
    for _ in range(2 if case.cuda_graphs else 1):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        run(label)
        if device == "cuda":
            times["peak:" + label] = [float(torch.cuda.max_memory_allocated())]
        # Graph replays accumulate into the captured .grad tensors: zeroed in place then.
        model.zero_grad(set_to_none=not case.cuda_graphs)


def speed_worker(rank: int, world_size: int, case: SpeedCase, device: str) -> dict:
    """Every configuration of `case`, interleaved, `repeats` times: wall seconds per run, for
    TeraPipe runs this stage's busy seconds (its cells' spans, "busy:" + label), and on a GPU
    each configuration's peak allocated bytes on this stage ("peak:" + label)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection

    from harness import forward_step
    from megatron_terapipe import forward_backward_terapipe

    config, model, batches, communicator = _stage_setup(rank, world_size, case, device)
    if case.cuda_graphs:  # every TeraPipe plan below runs with graphs (CPU: ReplayGraph)
        from harness import use_cell_graphs

        use_cell_graphs(config, next(p for p in case.plans.values() if p is not None), device)
    transfers = {}
    if communicator is not None:  # Megatron takes a communicator with every process group
        transfers = {"p2p_communicator": communicator,
                     "pg_collection": ProcessGroupCollection.use_mpu_process_groups()}
    seq = case.model.seq_length
    times: dict[str, list[float]] = {label: [] for label in case.plans}
    times.update({"busy:" + label: [] for label, plan in case.plans.items() if plan is not None})
    runs = []  # the TeraPipe calls' run records
    common = dict(forward_step_func=forward_step, model=[model], seq_length=seq,
                  num_microbatches=case.num_microbatches, micro_batch_size=1, **transfers)

    def run(label: str) -> None:
        plan = case.plans[label]
        if plan is None:
            forward_backward_pipelining_without_interleaving(data_iterator=iter(batches), **common)
        else:
            forward_backward_terapipe(data_iterator=iter(batches), plan=plan, on_run=runs.append,
                                      **common)

    for label in case.plans:
        _warm_up(label, run, model, case, device, times)
    labels = list(case.plans)
    for round_ in range(case.repeats):
        # Rotate the order every round, so each configuration follows each other one about
        # equally often: in a fixed order, the DP and uniform rows measured the same plan up
        # to 5% apart (the row right after Megatron's run the slower one).
        shift = round_ % len(labels)
        for label in labels[shift:] + labels[:shift]:
            model.zero_grad(set_to_none=not case.cuda_graphs)
            dist.barrier()
            start = time.perf_counter()
            run(label)
            if device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            times[label].append(time.perf_counter() - start)
            if case.plans[label] is not None:
                times["busy:" + label].append(sum(e.end - e.start for e in runs[-1].events))
    parallel_state.destroy_model_parallel()
    return times


def profile_cost_model(model: TinyGPT, granularity: int, layers_per_stage: int, device: str,
                       cache: Optional[str], dtype: str = "float32"):
    """A ProfiledCostModel of one layer of `model` measured here (cached in `cache`), with the
    first stage's embedding and the last stage's output layer and loss measured too."""
    from megatron_terapipe.megatron.measure.layers import measure_layer_times
    from megatron_terapipe.megatron.measure.edges import edge_points_for, measure_edge_times
    from megatron_terapipe.planner import (EdgeTimeFit, LayerTimeFit, ModelDims, ProfiledCostModel,
                                           fit_edge_times, fit_layer_times)
    from megatron_terapipe.planner.cost.dims import Link
    from megatron_terapipe.planner.profile.time_samples import default_grid

    dims = ModelDims(num_layers=model.num_layers, hidden_size=model.hidden_size,
                     num_attention_heads=model.num_attention_heads, vocab_size=model.vocab_size)
    measure = dict(dtype=dtype, device=device, repeats=3)

    def edges_match(edges: Optional[EdgeTimeFit]) -> bool:
        return (edges is not None and edges.vocab_size == model.vocab_size
                and edges.metadata.get("position_embedding_type") == model.position_embedding_type
                and edges.metadata.get("max_sequence_length") == model.seq_length)

    fit = None
    if cache and os.path.exists(cache):
        try:
            fit = LayerTimeFit.load(cache)
            if not fit.is_current_format:
                print(f"  the cached profile has the older format version {fit.format_version}: "
                      "measuring again")
                fit = None
        except ValueError as exc:
            print(f"  ignoring the cached profile: {exc}")
    if fit is None:
        measurements = measure_layer_times(dims, seq_length=model.seq_length, batch_sizes=(1,),
                                           granularity=granularity,
                                           position_embedding_type=model.position_embedding_type,
                                           **measure)
        fit = fit_layer_times(measurements)
        if cache:
            fit.save(cache)
    if not edges_match(fit.edges):  # a cached profile from before edges were measured
        print("  measuring the embedding and the output layer + loss ...", flush=True)
        points = edge_points_for(default_grid(model.seq_length, (1,), granularity))
        edges = measure_edge_times(dims, points, position_embedding_type=model.position_embedding_type,
                                   max_sequence_length=model.seq_length, **measure)
        fit = fit.with_edges(fit_edge_times(edges))
        if cache:
            fit.save(cache)
    # Stage-to-stage transfers stay on this host: loopback bandwidth, tiny latency.
    link = Link(bandwidth=5e9, latency=50e-6) if device == "cpu" else Link(bandwidth=100e9, latency=10e-6)
    return ProfiledCostModel(fit, layers_per_stage=layers_per_stage, link=link, model=dims,
                             dtype_bytes=2 if dtype == "bfloat16" else 4)


def plans_for(cost, model: TinyGPT, num_microbatches: int, granularity: int,
              stages: int) -> tuple[dict, dict]:
    """Megatron (None), the DP plan (better order by simulation) and the best uniform slicing."""
    from megatron_terapipe.planner import best_uniform_slicing, place_wgrad_points, solve
    from megatron_terapipe.planner.simulator import plan_time

    seq = model.seq_length
    best = None
    for order in ("1f1b", "gpipe"):
        plan = solve(cost, seq, 1, stages, granularity=granularity,
                     num_microbatches=num_microbatches, order=order, batch_sizes="none")
        if best is None or plan.predicted_time < best.predicted_time:
            best = plan
    uniform, _ = best_uniform_slicing(cost, seq, 1, stages, granularity=granularity,
                                      num_microbatches=num_microbatches, order=best.order)
    # The same weight-gradient mode as the DP plan (early W actions placed for its own
    # slicing), so the two differ only in their slicing.
    uniform = replace(uniform, defer_wgrad=best.defer_wgrad)
    if uniform.defer_wgrad:
        uniform, _ = place_wgrad_points(uniform, cost, num_microbatches, stages, 1)
    uniform = replace(uniform, predicted_time=plan_time(uniform, cost, num_microbatches, stages, 1))
    plans = {"megatron_1f1b": None, "terapipe_dp": best, "terapipe_uniform": uniform}
    info = {"dp_slices": list(best.seq_slices), "dp_order": best.order,
            "dp_defer_wgrad": best.defer_wgrad, "dp_wgrad_points": [list(p) for p in best.wgrad_points],
            "uniform_slices": len(uniform.seq_slices), "uniform_defer_wgrad": uniform.defer_wgrad,
            "uniform_wgrad_points": [list(p) for p in uniform.wgrad_points]}
    return plans, info


def predict(cost, plan: Optional[TeraPipePlan], model: TinyGPT, num_microbatches: int,
            cores: float, stages: int) -> float:
    """Simulated iteration time; Megatron's 1F1B is the 1f1b order with one slice."""
    from megatron_terapipe.planner.simulator import plan_time

    if plan is None:
        plan = TeraPipePlan([model.seq_length], order="1f1b")
    return plan_time(plan, cost, num_microbatches, stages, 1, cores)
