"""The capture-safety audit (runtime/graph_audit.py): it finds each kind of thing that would
break or invalidate a CUDA graph capture of a compute action, planted one at a time, naming the
op and the action, and finds nothing in the default plan's iterations on one stage (deferred
weight gradients on and off, 4 and 8 slices; the stage's cells, W actions and K/V buffers
included), on two stages in both orders with W on and off (received activations and
gradients come from the buffer pool, so they too sit at fixed addresses), with TP=2 x PP=2 and
with DP=2 x PP=2 under Megatron's DDP, once Megatron's embedding and loss run eagerly, as its
per-layer graphs leave them (the executor runs the user's loss_func eagerly); with Megatron's
loss inside the cells it finds it in every forward cell."""

from __future__ import annotations

import pytest
import torch

from harness import spawn
from megatron_terapipe.runtime.context import running_action
from megatron_terapipe.runtime.graph_audit import CaptureAudit, CaptureAuditError
from megatron_terapipe.schedule import Cell

CELL = Cell(0, 0, 1, 0, 2, 8, 8, 2)


def _run(body, device="cpu", iterations=1, **kwargs) -> CaptureAudit:
    audit = CaptureAudit(torch.device(device), **kwargs)
    with audit:
        for i in range(iterations):
            if i:
                audit.next_iteration()
            with running_action("F", CELL):
                body(i)
    return audit


PLANTED = {
    "sync": (lambda i: torch.ones(3).sum().item(), "aten._local_scalar_dense"),
    "copy from the host": (lambda i: torch.ones(3) * torch.tensor([1.0, 2.0, 3.0]),
                           "aten.lift_fresh"),
    "RNG": (lambda i: torch.nn.functional.dropout(torch.ones(4), 0.5), "aten.bernoulli_"),
}


@pytest.mark.parametrize("kind", list(PLANTED))
def test_a_planted_violation_is_found_with_its_op_and_action(kind):
    body, op = PLANTED[kind]
    audit = _run(body)
    with pytest.raises(CaptureAuditError, match=f"F m0 b0 t1: {kind} \\({op}"):
        audit.check()


def test_a_buffer_made_anew_each_iteration_is_found():
    audit = CaptureAudit(torch.device("cpu"))
    with audit:
        for i in range(2):
            if i:
                audit.next_iteration()
            buffer = torch.ones(4096 * (i + 1))  # outside every action
            with running_action("B", CELL):
                buffer.mul(2)
    with pytest.raises(CaptureAuditError, match=r"B m0 b0 t1: address changes \(aten.mul"):
        audit.check()


def test_a_buffer_kept_across_iterations_and_values_made_inside_pass():
    buffer = torch.ones(64)

    def body(i):
        local = torch.zeros(8)  # made inside the action: its address is the graph's
        return buffer.narrow(0, 0, 8) * 2 + local

    audit = _run(body, iterations=3)
    audit.check()
    assert audit.violations == []


def test_a_cpu_tensor_in_a_device_op_and_a_copy_to_the_device_are_found():
    # No GPU here: the meta device stands in for it (a device whose ops read no host data).
    def body(i):
        x = torch.ones(4, device="meta")
        x * torch.ones(())  # a CPU tensor (a 0-d one: its value is read at capture) in a meta op
        torch.ones(4).to("meta")  # a copy from the host

    audit = _run(body, device="meta")
    kinds = {v.kind for v in audit.violations}
    assert kinds == {"CPU tensor", "copy from the host"}, audit.violations


def test_rng_from_a_registered_graph_safe_generator_passes_and_zero_dropout_draws_nothing():
    generator = torch.Generator()

    def body(i):
        torch.rand(4, generator=generator)
        torch.nn.functional.dropout(torch.ones(4), 0.0)

    _run(body, graph_safe_generators=[generator]).check()
    with pytest.raises(CaptureAuditError, match="RNG"):
        _run(body).check()


def test_ops_outside_every_action_are_not_audited():
    audit = CaptureAudit(torch.device("cpu"))
    with audit:
        torch.ones(3).sum().item()
    audit.check()


@pytest.fixture(scope="module")
def stage_runs():
    return spawn(1, "harness.graph_runs:audit_one_stage", timeout=600)[0]


@pytest.mark.parametrize("run", ["deferred", "in_every_cell", "deferred_k8"])
def test_the_default_plan_on_one_stage_passes(stage_runs, run):
    assert stage_runs[run]["actions"] > 0
    assert stage_runs[run]["violations"] == [], "\n".join(stage_runs[run]["violations"])


def test_the_loss_func_runs_eagerly_so_its_syncs_do_not_break_a_capture(stage_runs):
    """The user's loss_func is Python the executor runs between graphs (tests/test_host_cost.py
    counts its syncs): a loss_func that reads its token count on the host is no finding here."""
    assert stage_runs["syncing_loss_func"]["violations"] == []


def test_megatrons_loss_inside_the_graph_is_found(stage_runs):
    """Its cross entropy writes `masked_target[target_mask] = 0`: a tensor from a Python value
    (and a changing host address) in every forward cell, which is why graphs leave it out."""
    found = stage_runs["loss_in_the_graph"]["violations"]
    assert {v.split(":")[0] for v in found} == {f"F m0 b0 t{t}" for t in range(4)}
    assert any("copy from the host (aten.lift_fresh" in v for v in found)


RUNS = [dict(order=o, defer_wgrad=d) for o in ("1f1b", "gpipe") for d in (True, False)]
PIPELINES = {"PP=2": (2, 1, False), "TP=2 x PP=2": (4, 2, False), "DP=2 x PP=2, DDP": (4, 1, True)}


@pytest.fixture(scope="module", params=list(PIPELINES))
def pipeline_runs(request):
    world, tp, ddp = PIPELINES[request.param]
    runs = RUNS if request.param == "PP=2" else RUNS[:1]  # both orders, W on and off: on PP=2
    return spawn(world, "harness.graph_runs:audit_pipeline", runs, tp, ddp, timeout=600)


def test_the_default_plan_on_pipelines_passes(pipeline_runs):
    for rank, found in enumerate(pipeline_runs):
        for run, violations in found.items():
            assert violations == [], f"{run}, rank {rank}:\n" + "\n".join(violations)
