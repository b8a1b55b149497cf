"""Timed pipeline runs shared by the schedule benchmarks: Megatron's 1F1B and TeraPipe plans on
the same stage models, interleaved round by round, plus the plans and predictions to compare.

`speed_worker` runs on every stage process (harness.spawn). A `SpeedCase` says what to run:
- on CPU: gloo, one core per stage (`pin_to_core`);
- on one GPU shared by the stages (`mps=True`): each process takes its SM share under CUDA MPS
  (mps.enter_stage) and both schedules move activations through host memory
  (host_staged.HostStagedP2PCommunicator, given to Megatron's 1F1B and to TeraPipe alike);
- on one GPU per stage: Megatron's own transfers.

Graphs (`SpeedCase.graphed`): a TeraPipe label listed there replays a graph per compute action
(a CUDA graph on a GPU, the ReplayGraph stand-in on CPU) and keeps its own plan memory, so the
same plan can also run eager under another label; a Megatron label listed there runs a copy of
the stage (same weights) built with Megatron-Core's own graphs, `cuda_graph_impl="local"`: each
TransformerLayer call is recorded in the first schedule call, captured by `create_cudagraphs`
at its end and replayed after; the embedding, output layer and loss stay eager. Megatron's
graphs need CUDA. Only rows with the same graphs may be compared: `graphs_of` names them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from harness import GLOO_AND_NCCL, TinyGPT
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
    graphed: tuple[str, ...] = ()  # labels that run with graphs (see the module's docstring)
    auto_trials: int = 0  # > 0: a MeasuredChoice among the labels first (measured_auto.py)
    predicted: dict = field(default_factory=dict)  # label -> simulated seconds, for its log
    cost: object = None  # the plans' cost model: measured auto calibrates it and re-plans


#: What a row's graphs are (graphs_of gives the key).
GRAPHS = {"none": "eager",
          "terapipe": "a CUDA graph per compute action (TeraPipe's --terapipe-cuda-graphs)",
          "terapipe_cpu": "the ReplayGraph stand-in per compute action (CPU: checks the path, "
                          "not the speed of CUDA graphs)",
          "megatron": "Megatron-Core's CudaGraphManager (cuda_graph_impl=local): a graph per "
                      "transformer layer call; embedding, output layer and loss eager"}


def graphs_of(label: str, plan: Optional[TeraPipePlan], case: SpeedCase, device: str) -> str:
    """The GRAPHS key of a row."""
    if label not in case.graphed:
        return "none"
    if plan is None:
        return "megatron"
    return "terapipe" if device == "cuda" else "terapipe_cpu"


def _stage_setup(rank: int, world_size: int, case: SpeedCase, device: str):
    """This stage's model, batches and the communicator both schedules use (None: default)."""
    from megatron.core import parallel_state

    from harness import build_stage_model, in_precision, make_batches, to_device

    if case.mps:
        from mps import enter_stage

        enter_stage(rank, world_size)
    if device == "cpu":
        from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode, pin_to_core

        enable_cpu_mode()
        pin_to_core(rank, world_size)  # one core per stage, as one GPU per rank on GPUs
    parallel_state.initialize_model_parallel(1, world_size)
    config, model = build_stage_model(case.model, 1, world_size)
    model = in_precision(config, to_device(model, device))
    communicator = None
    if case.mps:
        from host_staged import HostStagedP2PCommunicator

        communicator = HostStagedP2PCommunicator(
            parallel_state.get_pipeline_model_parallel_group(), config)
        # TeraPipe's transport over the same communicator
        from megatron_terapipe import TeraPipeConfig

        config.terapipe = replace(getattr(config, "terapipe", None) or TeraPipeConfig(),
                                  transport="megatron")
    batches = [{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
               for b in make_batches(case.num_microbatches, 1, case.model.seq_length,
                                     case.model.vocab_size, masked_rows=False)]
    return config, model, batches, communicator


def _megatron_graphed_model(case: SpeedCase, world_size: int, eager, device: str):
    """A copy of this stage (the eager model's weights) built with Megatron-Core's own graphs."""
    import dataclasses

    from megatron.core import parallel_state

    from harness import in_precision, to_device
    from harness.models import seed
    from megatron_terapipe.megatron.model.layer_specs import get_gpt_layer_spec

    if device != "cuda":
        raise ValueError("a graphed Megatron row needs CUDA (Megatron-Core's CudaGraphManager "
                         "captures torch.cuda graphs): leave Megatron labels out of "
                         "SpeedCase.graphed on CPU")
    config = dataclasses.replace(case.model.config(1, world_size), cuda_graph_impl="local")
    seed(case.model.seed)
    model = case.model.build(config, get_gpt_layer_spec(**case.model.spec_kwargs),
                             pre_process=parallel_state.is_pipeline_first_stage(),
                             post_process=parallel_state.is_pipeline_last_stage())
    model = in_precision(config, to_device(model, device))
    model.load_state_dict(eager.state_dict())
    return model


def _warm_up(label: str, run, models: dict, case: SpeedCase, device: str, times: dict) -> None:
    """Allocator, kernels, connections (with graphs: the capture too); then the peak memory:
    absolute ("peak:"), and over what the process held when the run started ("added:"; the
    earlier labels' models, pools and graphs stay allocated, so only this one compares)."""
    for _ in range(2 if label in case.graphed else 1):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
        run(label)
        if device == "cuda":
            peak = float(torch.cuda.max_memory_allocated())
            times["peak:" + label], times["added:" + label] = [peak], [peak - held]
        _zero_grads(models[label], case)


def _zero_grads(model, case: SpeedCase) -> None:
    # Graph replays accumulate into the captured .grad tensors: zeroed in place then.
    model.zero_grad(set_to_none=not case.graphed)


def _runner(case: SpeedCase, device: str, models: dict, batches: list, common: dict, runs: list):
    """run(label): one iteration of the label's schedule on its model (TeraPipe labels each on
    their own plan memory, graphed or not)."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    from harness import use_cell_graphs
    from megatron_terapipe import forward_backward_terapipe

    memories = {label: OrderedDict() for label in case.plans}
    graphed = [label for label, plan in case.plans.items() if plan is not None and label in case.graphed]
    if graphed:  # the graph maker for this device; each run below says whether it graphs
        use_cell_graphs(models[graphed[0]].config, case.plans[graphed[0]], device)

    def run(label: str) -> None:
        plan, model = case.plans[label], models[label]
        if plan is None:
            forward_backward_pipelining_without_interleaving(
                data_iterator=iter(batches), model=[model], **common)
            return
        from megatron_terapipe import TeraPipeConfig

        model.config.terapipe = replace(getattr(model.config, "terapipe", None) or TeraPipeConfig(),
                                        cuda_graphs=label in case.graphed)
        # the label's buffers and graphs (auto's re-planned label gets its own when it joins)
        model.__dict__["_terapipe_pools"] = memories.setdefault(label, OrderedDict())
        forward_backward_terapipe(data_iterator=iter(batches), model=[model], plan=plan,
                                  on_run=runs.append, **common)

    return run


#: The stage processes' backend by device. On a GPU, NCCL for CUDA tensors, so that TeraPipe's
#: captured loss cells can hold the TP all-reduce; transfers stay on gloo with host tensors
#: (host_staged.py).
STAGE_BACKEND = {"cpu": "gloo", "cuda": GLOO_AND_NCCL}


def _measured_auto(case: SpeedCase, world_size: int, run, rows: tuple, host) -> dict:
    """measured_auto.choose_in_stages on this stage; `rows`: the eager model, and the models,
    labels and times that a re-planned plan joins as a row of its own."""
    from measured_auto import choose_in_stages

    model, models, labels, times = rows
    unique = list({id(m): m for m in models.values()}.values())

    def add_label(label: str, plan: TeraPipePlan, graphed: bool) -> None:
        case.plans[label], models[label] = plan, model
        case.graphed = (*case.graphed, label) if graphed else case.graphed
        labels.append(label)
        times[label], times["busy:" + label] = [], []
        if graphed:  # its eager warm-up here, so that the trial's own warm-up captures
            run(label)

    return choose_in_stages(case, world_size, run, add_label,
                            lambda: [_zero_grads(m, case) for m in unique], host)


def speed_worker(rank: int, world_size: int, case: SpeedCase, device: str) -> dict:
    """Every configuration of `case`, interleaved, `repeats` times: wall seconds per run, for
    TeraPipe runs this stage's busy seconds (its cells' spans, "busy:" + label), and on a GPU
    each configuration's peak allocated bytes on this stage ("peak:" + label) and the peak over
    what the stage held when its run started ("added:" + label)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from harness import forward_step

    _, model, batches, communicator = _stage_setup(rank, world_size, case, device)
    models = {label: model for label in case.plans}
    labels = list(case.plans)
    for label in [label for label in labels if case.plans[label] is None and label in case.graphed]:
        models[label] = _megatron_graphed_model(case, world_size, model, device)
        # Its first call captures and ends on the default stream: before any other warm-up.
        labels.remove(label)
        labels.insert(0, label)
    transfers = {}
    if communicator is not None:  # Megatron takes a communicator with every process group
        transfers = {"p2p_communicator": communicator,
                     "pg_collection": ProcessGroupCollection.use_mpu_process_groups()}
    times: dict[str, list[float]] = {label: [] for label in case.plans}
    times.update({"busy:" + label: [] for label, plan in case.plans.items() if plan is not None})
    runs = []  # the TeraPipe calls' run records
    common = dict(forward_step_func=forward_step, seq_length=case.model.seq_length,
                  num_microbatches=case.num_microbatches, micro_batch_size=1, **transfers)
    run = _runner(case, device, models, batches, common, runs)
    # Host barriers over gloo: with NCCL for CUDA tensors (STAGE_BACKEND) a plain barrier could
    # go to NCCL, which refuses two ranks on one GPU.
    host = dist.new_group(backend="gloo")
    for label in labels:
        _warm_up(label, run, models, case, device, times)
    if case.auto_trials:  # the kept labels and rank 0's log lines, under "auto"
        times["auto"] = _measured_auto(case, world_size, run, (model, models, labels, times),
                                       host)
    for round_ in range(case.repeats):
        # Rotate the order every round, so each configuration follows each other one about
        # equally often: in a fixed order, the DP and uniform rows measured the same plan up
        # to 5% apart (the row right after Megatron's run the slower one).
        shift = round_ % len(labels)
        for label in labels[shift:] + labels[:shift]:
            _zero_grads(models[label], case)
            dist.barrier(group=host)
            start = time.perf_counter()
            run(label)
            if device == "cuda":
                torch.cuda.synchronize()
            dist.barrier(group=host)
            times[label].append(time.perf_counter() - start)
            if case.plans[label] is not None:
                times["busy:" + label].append(sum(e.end - e.start for e in runs[-1].events))
    parallel_state.destroy_model_parallel()
    return times
