"""Graph-ready cells: the capture audit (runtime/graphs/graph_audit.py) and CUDA graphs per compute
action (runtime/graphs/cell_graphs.py, --terapipe-cuda-graphs), on CPU.

- Each kind of violation planted inside a cell fails the audit, naming the op and the cell;
  the same op outside a cell does not.
- The default plan passes the audit on the local spec at PP=2 for both orders with deferral
  on and off, at TP=2 x PP=2 and at DP=2 x PP=2 with Megatron DDP, on fresh batches each
  iteration, and the buffer pool allocates nothing after the warm-up; planted syncs and moved
  addresses in a real run are caught and attributed.
- With a recording graph factory, every compute action is captured once at the second
  iteration (numerically the same as the eager iteration) and only replayed after; without
  CUDA the option and the flag are refused, naming them.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from harness import spawn
from harness.runs.graph_runs import AuditRun
from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from megatron_terapipe.megatron.args.flags import add_terapipe_args
from megatron_terapipe.runtime.graphs.cell_graphs import CellGraphs, RecordingGraph, cuda_graph_factory
from megatron_terapipe.runtime.context import running_action
from megatron_terapipe.runtime.graphs.graph_audit import CaptureAudit, CaptureSafetyError
from megatron_terapipe.schedule import Cell

CELL = Cell(microbatch=1, batch_slice=0, token_slice=2, row_start=0, rows=2, token_start=8,
            tokens=4, num_token_slices=4)


def _audit(action, iterations: int = 1, device=None, inside: bool = True):
    audit = CaptureAudit(device)
    for i in range(iterations):
        if i:
            audit.next_iteration()
        with audit:
            if inside:
                with running_action("F", CELL):
                    action(i)
            else:
                action(i)
    return audit.report()


def _only(report, kind: str, op: str):
    assert [v.kind for v in report.violations] == [kind], report.violations
    violation = report.violations[0]
    assert op in violation.op and violation.cell == "F(m1b0t2)"
    with pytest.raises(CaptureSafetyError, match=rf"{kind}: .*{op}.* in cell F\(m1b0t2\)"):
        report.check()


X = torch.ones(4)


PLANTED = {
    "sync": (lambda i: float(X.sum()), "_local_scalar_dense"),
    "host_to_device": (lambda i: torch.tensor([1.0, 2.0, 3.0, 4.0]), "lift_fresh"),
    "rng": (lambda i: torch.rand(4, generator=torch.Generator()), "rand"),
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_planted_violation_is_named_with_op_and_cell(kind):
    action, op = PLANTED[kind]
    _only(_audit(action), kind, op)
    assert _audit(action, inside=False).violations == []  # outside a cell: not the graphs'


def test_host_tensor_from_python_data_used_in_a_cell():
    audit = CaptureAudit()
    with audit:
        host = torch.tensor([0.5, 0.5, 0.5, 0.5]).float()  # outside a cell: fine, but host
        with running_action("F", CELL):
            X.mul(host)
    _only(audit.report(), "host_tensor", "mul")


def test_gpu_rules_flag_cpu_tensors_but_not_cpu_scalars():
    # On a GPU run any CPU tensor with elements is a host tensor; 0-dim ones are kernel scalars.
    # (meta stands in for the GPU here)
    on_device = torch.ones(4, device="meta")
    report = _audit(lambda i: (X.sum(), on_device.mul(torch.ones(()))), device="meta")
    assert [(v.kind, v.op) for v in report.violations] == [("host_tensor", "aten.sum.default")]


def test_python_numbers_are_constants_not_violations():
    def action(i):
        y = X.clone()
        y[y > 0] = 0.0  # lifts a 0-dim tensor, as Megatron's cross entropy does
        return y * 2.0

    assert _audit(action, iterations=2).violations == []


def test_address_that_moves_between_iterations():
    fresh = {}

    def action(i):
        fresh[i] = torch.full((4,), float(i))
        return X + fresh[i]

    # made inside the cell: under capture the graphs' pool holds it, nothing to report
    assert _audit(action, iterations=2).violations == []
    audit = CaptureAudit()
    kept = []
    for i in range(2):
        if i:
            audit.next_iteration()
        with audit:
            kept.append(torch.full((1024,), float(i)))  # made outside the cell, anew
            with running_action("F", CELL):
                X.repeat(256).add(kept[-1])
    _only(audit.report(), "address", "add")


def test_cell_graphs_capture_once_then_replay():
    graphs = CellGraphs(RecordingGraph, warmup_iterations=1)
    ran = []
    for _ in range(3):
        graphs.start_iteration()
        result, replayed = graphs.run("F m0 b0 t0", lambda: ran.append(1) or X * 2)
    assert len(ran) == 2 and replayed and torch.equal(result, X * 2)
    graph = graphs.graphs["F m0 b0 t0"]
    assert (graph.calls, graph.replays) == (1, 2) and graph.ops == ["aten.mul.Tensor"]


def test_cuda_graphs_refused_without_cuda():
    from megatron_terapipe import configure

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="--terapipe-cuda-graphs.*need a CUDA device"):
        cuda_graph_factory()
    with pytest.raises(ValueError, match="cuda_graphs=True.*no CUDA device"):
        configure(argparse.Namespace(), _plan(), cuda_graphs=True)


@pytest.mark.parametrize("config, model, message", [
    ({"num_moe_experts": 4}, None, r"cuda_graphs=True\).*MoE layers"),
    ({}, argparse.Namespace(ddp_config=argparse.Namespace(overlap_grad_reduce=True)),
     "overlap_grad_reduce would never see"),
])
def test_graph_option_refused_for_what_cannot_replay(config, model, message):
    from megatron_terapipe import TeraPipeConfig
    from megatron_terapipe.megatron.hooks.forward_backward import check_support

    with pytest.raises(ValueError, match=message):
        check_support(argparse.Namespace(terapipe=TeraPipeConfig(cuda_graphs=True), **config), model)
    check_support(argparse.Namespace(terapipe=TeraPipeConfig(cuda_graphs=False), **config),
                  model)  # graphs off


def _plan():
    from megatron_terapipe import TeraPipePlan

    return TeraPipePlan([32, 32])


def _flags(*argv, **megatron) -> argparse.Namespace:
    args = add_terapipe_args(argparse.ArgumentParser()).parse_args(list(argv))
    for key, value in dict(seq_length=64, num_layers=4, pipeline_model_parallel_size=2,
                           **megatron).items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("argv, megatron, message", [
    (["--pipeline-schedule", "terapipe", "--terapipe-cuda-graphs"], {}, "no CUDA device"),
    (["--pipeline-schedule", "terapipe", "--terapipe-cuda-graphs", "--terapipe-cpu"], {},
     "--terapipe-cpu runs on CPU"),
    (["--terapipe-cuda-graphs"], {}, "--terapipe-cuda-graphs needs --pipeline-schedule terapipe"),
    (["--pipeline-schedule", "terapipe", "--terapipe-cuda-graphs"], {"overlap_grad_reduce": True},
     "--overlap-grad-reduce would never see gradients ready"),
    (["--pipeline-schedule", "terapipe", "--terapipe-cuda-graphs"], {"num_experts": 4},
     r"MoE layers \(--num-experts\) route tokens with counts read on the host"),
])
def test_flag_refused_naming_it(argv, megatron, message):
    if torch.cuda.is_available() and "no CUDA" in message:
        pytest.skip("this machine has CUDA")
    with pytest.raises(TeraPipeArgumentError, match=message) as info:
        validate_terapipe_args(_flags(*argv, **megatron))
    assert "--terapipe-cuda-graphs" in str(info.value)


PP2_RUNS = [AuditRun(f"{order}_defer_{'on' if defer else 'off'}", order=order, defer_wgrad=defer)
            for order in ("1f1b", "gpipe") for defer in (True, False)]
PLANTED_RUNS = [AuditRun("planted_sync", plant="sync"), AuditRun("planted_address", plant="address")]
FOUR_RUNS = [AuditRun("tp2_pp2", tp=2), AuditRun("dp2_pp2_ddp")]


@pytest.fixture(scope="module")
def two_process_audits():
    return spawn(2, "harness.runs.graph_runs:audit_runs", PP2_RUNS + PLANTED_RUNS, timeout=600)


@pytest.mark.parametrize("run", [r.name for r in PP2_RUNS])
def test_default_plan_passes_the_audit(two_process_audits, run):
    for rank_result in two_process_audits:
        assert rank_result[run] == [], rank_result[run]


def test_planted_violations_in_a_real_run_are_attributed(two_process_audits):
    first, last = two_process_audits
    assert first["planted_sync"] == [] and first["planted_address"] == []
    syncs = last["planted_sync"]
    assert len(syncs) == 12 and all("_local_scalar_dense" in v for v in syncs)  # 3 x 4 cells
    assert any("in cell F(m2b0t3)" in v for v in syncs)
    moved = last["planted_address"]
    assert any(v.startswith("address: aten.mul.Tensor in cell F(m0b0t0)") for v in moved)
    assert any("in cell B(m2b0t0)" in v for v in moved)  # the backward reads it too


def test_default_plan_passes_the_audit_with_tp_and_ddp():
    results = spawn(4, "harness.runs.graph_runs:audit_runs", FOUR_RUNS, timeout=600)
    for rank_result in results:
        for run in FOUR_RUNS:
            assert rank_result[run.name] == [], (run.name, rank_result[run.name])


def test_cuda_graph_path_captures_every_action_once():
    results = spawn(2, "harness.runs.graph_runs:graph_runs", 3, True, timeout=600)
    for r in results:
        eager, capture, replay = r["iterations"]
        # 3 microbatches x (4 forwards + 4 backwards + 1 W action) on each stage
        assert (eager["graphs"], capture["graphs"], replay["graphs"]) == (0, 27, 27)
        assert capture["new_calls"] == 27 and replay["new_calls"] == 0
        assert replay["replays"] == 2 * 27
        assert sorted(k[0] for k in r["keys"]) == ["B"] * 12 + ["F"] * 12 + ["W"] * 3
        assert all(count > 0 for count in r["captured_ops"].values())
        # the capture iteration computes exactly what the eager one did
        assert capture["losses"] == eager["losses"]
        assert eager["grads"].keys() == capture["grads"].keys() and eager["grads"]
        for name, grad in eager["grads"].items():
            assert torch.equal(grad, capture["grads"][name]), name
        # replays return the captured loss reports, one per microbatch
        assert len(replay["losses"]) == len(eager["losses"])
