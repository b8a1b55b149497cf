"""Training with every compute action replayed as a CUDA graph would (runtime/graphs/cpu_graph.py),
against the same training run eager.

`replay_vs_eager` trains one stage model per run twice from the same weights: eager, and with
`configure(..., cuda_graphs=True, graph_factory=ReplayGraph)` (one warm-up iteration, one
capture, replays after). Every iteration takes fresh batches and ends with an in-place SGD step,
as training does, so a replay that read a stale input, a stale weight or a value frozen at
capture would give other numbers. Returns per run and iteration the losses and every parameter
gradient of both, and the graphs' counts. With `device="cuda"` (tests/runtime/graphs/test_gpu_graphs.py) the
stage runs on the GPU and each action is a real torch.cuda.CUDAGraph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from ..models import TinyGPT, build_stage_model, forward_step, make_batches, to_device
from ..process_groups import release_model_parallel

LEARNING_RATE = 0.05


@dataclass(frozen=True)
class ReplayRun:
    name: str
    tp: int = 1
    pp: int = 2
    order: str = "1f1b"
    defer_wgrad: bool = True
    slices: int = 4
    iterations: int = 4
    microbatches: int = 3
    model: tuple[tuple[str, Any], ...] = ()  # TinyGPT fields other than its defaults
    device: str = "cpu"  # "cuda": the stage on the GPU, graphs of torch.cuda.CUDAGraph
    transport: str = ""  # "megatron": Megatron's P2P communicator (its receive buffers need grad)
    edges: tuple = ()  # TeraPipePlan.edge_slices: whole sequences, these microbatches cut

    def cells(self) -> int:
        """Cells per stage in an iteration."""
        if not self.edges:
            return self.microbatches * self.slices
        (first, head), (last, tail) = self.edges
        return len(head) * first + len(tail) * last + self.microbatches - first - last


class _Counted:
    """A graph that counts its replays (torch.cuda.CUDAGraph does not)."""

    def __init__(self, graph) -> None:
        self.graph, self.replays = graph, 0

    def capture(self, run):
        return self.graph.capture(run)

    def replay(self) -> None:
        self.replays += 1
        self.graph.replay()


def graph_maker(device: str):
    """What makes each cell's graph on `device`: torch.cuda.CUDAGraph on a GPU, the ReplayGraph
    stand-in on CPU (it checks the path and numbers, not the speed of CUDA graphs)."""
    from megatron_terapipe.runtime.graphs.cell_graphs import cuda_graph_factory
    from megatron_terapipe.runtime.graphs.cpu_graph import ReplayGraph

    return cuda_graph_factory(torch.device("cuda")) if device == "cuda" else ReplayGraph


def use_cell_graphs(config, plan, device: str) -> None:
    """`--terapipe-cuda-graphs` for `plan` on `device` (graph_maker's graphs)."""
    from megatron_terapipe import configure

    configure(config, plan, cuda_graphs=True, graph_factory=graph_maker(device))


def _graph_factory(run: ReplayRun, graphs: list):
    """graph_maker's graphs, each kept in `graphs` and counting its replays."""
    make = graph_maker(run.device)

    def factory(key: str):
        graphs.append(_Counted(make(key)))
        return graphs[-1]
    return factory


def _model(model_cfg: TinyGPT, run: ReplayRun, dp: int, graphs: Optional[list]):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_terapipe import TeraPipePlan, configure

    spec = None
    if model_cfg.sequence_parallel:  # its norms need the decoder block spec, as in the equivalence tests
        from megatron_terapipe.megatron.model.layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(model_cfg.config(run.tp, run.pp))
    config, model = build_stage_model(model_cfg, run.tp, run.pp, spec)
    model = to_device(model, run.device)
    if dp > 1:
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
    if run.transport:
        from megatron_terapipe import TeraPipeConfig

        config.terapipe = replace(getattr(config, "terapipe", None) or TeraPipeConfig(),
                                  transport=run.transport)
    slices = [model_cfg.seq_length] if run.edges else \
        TeraPipePlan.uniform(model_cfg.seq_length, run.slices).seq_slices
    plan = TeraPipePlan(slices, order=run.order, defer_wgrad=run.defer_wgrad,
                        edge_slices=run.edges)
    if graphs is None:
        configure(config, plan)
    else:
        configure(config, plan, cuda_graphs=True, graph_factory=_graph_factory(run, graphs))
    return model


def _gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the optimizer reads it (DDP's main_grad, else .grad)."""
    out = {}
    for name, param in model.named_parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        out[name] = grad.detach().to("cpu", copy=True) if grad is not None else None
    return out


def _zero_and_step(model, dp: int) -> None:
    """SGD in place, then gradients zeroed in place (a graph writes where the capture found them)."""
    with torch.no_grad():
        for param in model.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                param.add_(grad, alpha=-LEARNING_RATE)
    if dp > 1:
        model.zero_grad_buffer()
    else:
        model.zero_grad(set_to_none=False)


def train(run: ReplayRun, world_size: int, graphed: bool) -> list[dict[str, Any]]:
    from megatron.core import parallel_state

    from megatron_terapipe.megatron.hooks.forward_backward import forward_backward_terapipe

    dp = world_size // (run.tp * run.pp)
    parallel_state.initialize_model_parallel(run.tp, run.pp)
    model_cfg = TinyGPT(**{"num_layers": 2 * run.pp, **dict(run.model)})
    graphs: Optional[list] = [] if graphed else None
    model = _model(model_cfg, run, dp, graphs)
    iterations = []
    for iteration in range(run.iterations):
        seed = 100 * iteration + parallel_state.get_data_parallel_rank()
        batches = make_batches(run.microbatches, 2, model_cfg.seq_length, model_cfg.vocab_size, seed=seed)
        batches = [{k: v.to(run.device) if v is not None else None for k, v in b.items()}
                   for b in batches]
        reports = forward_backward_terapipe(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=run.microbatches, seq_length=model_cfg.seq_length, micro_batch_size=2)
        iterations.append({"losses": [r["lm loss"].detach().to("cpu", copy=True) for r in reports],
                           "grads": _gradients(model),
                           "graphs": len(graphs) if graphs is not None else 0,
                           "replays": sum(g.replays for g in graphs) if graphs is not None else 0})
        _zero_and_step(model, dp)
    del model, graphs  # the model holds its groups: their threads end when it goes
    release_model_parallel()
    return iterations


def replay_vs_eager(rank: int, world_size: int, runs: list[ReplayRun]) -> dict[str, Any]:
    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode

    if any(run.device == "cuda" for run in runs):
        torch.cuda.set_device(0)
    else:
        enable_cpu_mode()
    return {run.name: {"eager": train(run, world_size, False), "graphed": train(run, world_size, True)}
            for run in runs}
