"""CUDA graphs per compute action replay the right numbers (runtime/graphs/cpu_graph.py, on CPU).

A `ReplayGraph` replays like a CUDA graph: the captured ops again, on the captured storages,
with no Python. Training with `configure(..., cuda_graphs=True, graph_factory=ReplayGraph)`
(warm-up, capture, then replays; fresh batches and an in-place SGD step every iteration) gives
the eager run's losses and every parameter gradient exactly (torch.equal: the same aten ops on
the same values), at PP=2 in both orders with deferral on and off, with full and selective
recompute, per-token loss with RMSNorm and grouped queries, through Megatron's P2P
communicator (whose receive buffers require grad), and (slow) at DP=2 x PP=2 with
Megatron DDP and TP=2 x PP=2 with and without sequence parallelism. The stand-in itself: replays
see in-place changes of their inputs, keep what was computed on the host at capture, and refuse
host reads; gradients set to None after the capture are refused before the iteration.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from harness import spawn
from harness.runs.replay_runs import ReplayRun
from megatron_terapipe.runtime.graphs.cell_graphs import CellGraphs
from megatron_terapipe.runtime.graphs.cpu_graph import ReplayGraph


def test_replay_redoes_the_ops_on_the_captured_storages():
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    graph = ReplayGraph("F m0 b0 t0")
    total = torch.zeros(())
    out = graph.capture(lambda: (x @ w).relu().sum(dim=0).add_(total))
    graph.replay()  # the replay after capture: capture already ran it
    assert torch.equal(out, (x @ w).relu().sum(dim=0))
    x.mul_(-2.0)
    w.add_(1.0)
    total.fill_(5.0)
    graph.replay()
    assert torch.equal(out, (x @ w).relu().sum(dim=0) + 5.0)
    assert graph.replays == 2


def test_replay_keeps_values_computed_on_the_host_at_capture():
    x = torch.ones(4)
    scale = {"value": 2.0}
    graph = ReplayGraph("F m0 b0 t0")
    out = graph.capture(lambda: x * scale["value"])
    graph.replay()
    scale["value"] = 3.0  # a Python number: frozen into the graph, as on a GPU
    fresh = x + 1.0  # a tensor made anew outside: the graph still reads the old x
    graph.replay()
    assert torch.equal(out, torch.full((4,), 2.0)) and fresh is not x


def test_host_read_inside_a_capture_is_refused():
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="_local_scalar_dense.*captured action F m0 b0 t1"):
        ReplayGraph("F m0 b0 t1").capture(lambda: x * float(x.sum()))


def test_replayed_backward_accumulates_where_the_capture_did_and_moved_grads_are_refused():
    layer, x = torch.nn.Linear(4, 2), torch.randn(3, 4)
    expected = torch.autograd.grad(layer(x).square().sum(), layer.weight)[0]
    graphs = CellGraphs(ReplayGraph)
    for _ in range(4):  # warm-up, capture, two replays
        layer.zero_grad(set_to_none=False)
        graphs.start_iteration(layer.named_parameters())
        graphs.run("B m0 b0 t0", lambda: layer(x).square().sum().backward())
        graphs.end_iteration(layer.named_parameters())
        assert torch.equal(layer.weight.grad, expected)
    assert graphs.graphs["B m0 b0 t0"].replays == 3
    layer.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"--terapipe-cuda-graphs.*weight\.grad was set to None"
                                         r".*zero_grad\(set_to_none=False\)"):
        graphs.start_iteration(layer.named_parameters())


def _assert_replays_match(result: dict, name: str, graphs: int) -> None:
    eager, graphed = result["eager"], result["graphed"]
    assert len(eager) == len(graphed) >= 4
    for i, (e, g) in enumerate(zip(eager, graphed)):
        assert len(e["losses"]) == len(g["losses"]), (name, i)
        for a, b in zip(e["losses"], g["losses"]):
            assert torch.equal(a, b), (name, i, a, b)
        assert e["grads"].keys() == g["grads"].keys()
        assert any(v is not None for v in e["grads"].values()), name
        for param, grad in e["grads"].items():
            other = g["grads"][param]
            assert (grad is None) == (other is None), (name, i, param)
            assert grad is None or torch.equal(grad, other), (name, i, param)
    # eager warm-up, capture of every action at the second iteration, replays only after
    assert [it["graphs"] for it in graphed] == [0] + [graphs] * (len(graphed) - 1), name
    assert graphed[-1]["replays"] == graphs * (len(graphed) - 1), name


PP2_RUNS = [ReplayRun(f"{order}_defer_{'on' if defer else 'off'}", order=order, defer_wgrad=defer)
            for order in ("1f1b", "gpipe") for defer in (True, False)] + [
    ReplayRun("recompute_full", model=(("recompute_granularity", "full"),)),
    ReplayRun("recompute_selective", model=(("recompute_granularity", "selective"),)),
    ReplayRun("per_token_loss_rmsnorm_gqa", model=(
        ("calculate_per_token_loss", True), ("normalization", "RMSNorm"), ("num_query_groups", 2))),
    # Megatron's communicator hands back receive buffers that require grad (as the GPU pipeline
    # benchmark's host-staged one does): the graphs' pooled copies of them must stay leaves
    ReplayRun("megatron_transport", transport="megatron"),
    # edge slicing: microbatches of 2, 1 and 3 cells, the 1f1b order counting sequences
    ReplayRun("edge_slices", edges=((1, (8, 8)), (1, (4, 4, 8)))),
]


@pytest.mark.parametrize("run", PP2_RUNS, ids=[r.name for r in PP2_RUNS])
def test_replayed_training_equals_eager_pp2(pp2_replays, run):
    # per stage: each cell's F and B (3 microbatches x 4 token slices), a W per microbatch
    graphs = run.cells() * 2 + (3 if run.defer_wgrad else 0)
    for rank_result in pp2_replays:
        _assert_replays_match(rank_result[run.name], run.name, graphs)


@pytest.fixture(scope="module")
def pp2_replays():
    return spawn(2, "harness.runs.replay_runs:replay_vs_eager", PP2_RUNS, timeout=600)


FOUR_RUNS = [ReplayRun("dp2_pp2_ddp"), ReplayRun("tp2_pp2", tp=2),
             ReplayRun("tp2_pp2_sequence_parallel", tp=2, model=(("sequence_parallel", True),))]


@pytest.mark.slow
def test_replayed_training_equals_eager_with_ddp_and_tp():
    for rank_result in spawn(4, "harness.runs.replay_runs:replay_vs_eager", FOUR_RUNS, timeout=600):
        for run in FOUR_RUNS:
            _assert_replays_match(rank_result[run.name], run.name, 3 * 4 * 2 + 3)


def test_cuda_capture_orders_streams_without_synchronizing_the_device(monkeypatch):
    """A stage captures mid-iteration, with receives posted ahead that wait for a peer: a
    device-wide synchronize (as `with torch.cuda.graph` does first) would deadlock. The capture
    must only order its side stream after the current one, capture in thread_local mode, end
    the capture when the action raises, and order the current stream after the side one."""
    from megatron_terapipe.runtime.graphs import cell_graphs

    calls = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append(f"{self.name} waits {other.name}")

    class Graph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            calls.append(f"begin pool={pool} mode={capture_error_mode}")

        def capture_end(self):
            calls.append("end")

    current, side = Stream("current"), Stream("side")
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(cuda, "current_stream", lambda: current)
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext(calls.append(f"on {s.name}")))
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(cuda, name, lambda *a, name=name: pytest.fail(f"torch.cuda.{name} called"))
    graph = cell_graphs.TorchCUDAGraph(pool=(0, 7), stream=side)
    assert graph.capture(lambda: calls.append("run") or "out") == "out"
    assert calls == ["side waits current", "on side", "begin pool=(0, 7) mode=thread_local",
                     "run", "end", "current waits side"]
    calls.clear()
    with pytest.raises(RuntimeError, match="boom"):
        graph.capture(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert calls[-1] == "end"
