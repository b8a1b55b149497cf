"""Random MoE router-loss runs: any mix of Megatron's losses under any plan.

test_moe_losses.py checks each loss and layout by hand; here a seeded `random.Random` (the same
draws every run) draws the losses (any non-empty subset of aux_loss, seq_aux_loss and
global_aux_loss with random coefficients, the z-loss or not, or aux-loss-free expert bias),
per-token loss or not, padding masks or not, and the plan (any slicing, either order, W
actions deferred or not and moved anywhere at or after their backwards, one chunk or two per
rank, edge slicing), the microbatch count and size; every draw runs against Megatron's
no-pipelining run in the same layout (harness/moe_runs.py): every gradient, reported loss and
logged MoE loss at the fp32 tolerances (harness.compare.FP32) and the router buffers exactly.
2 processes (PP=2) and 4 (DP=2 x PP=2 with DDP, expert parallel or not; TP=2 x PP=2 with
sequence parallelism, which Megatron requires of MoE with TP). TERAPIPE_RANDOM_SEED and
TERAPIPE_RANDOM_RUNS draw other or more runs (docs/testing.md).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from harness.inputs.draws import RUNS, SEED, SEQ, composition, draw_edge_plan, random_cases, w_places
from harness.runs.moe_runs import MoECase, MoEGPT, check_moe_case
from megatron_terapipe import TeraPipePlan
from megatron_terapipe.megatron.platform import router_versions

BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def draw_model(rng: random.Random, sequence_parallel: bool = False) -> MoEGPT:
    """Random router losses on the 4-expert top-2 model."""
    per_token = rng.random() < 0.4
    if rng.random() < 0.15:  # aux-loss-free balancing, with or without an aux loss beside it
        coeffs = (0.0,) if rng.random() < 0.5 else (0.5,)
        return MoEGPT(expert_bias=True, aux_coeffs=coeffs, calculate_per_token_loss=per_token,
                      sequence_parallel=sequence_parallel)
    kinds = tuple(k for k in BALANCING if rng.random() < 0.5) or (rng.choice(BALANCING),)
    coeffs = tuple(round(rng.uniform(0.1, 0.6), 2) for _ in kinds)
    z_loss = round(rng.uniform(0.05, 0.2), 2) if rng.random() < 0.6 else None
    return MoEGPT(balancing=kinds, aux_coeffs=coeffs, z_loss_coeff=z_loss,
                  calculate_per_token_loss=per_token, sequence_parallel=sequence_parallel)


def draw_plan(rng: random.Random, M: int, rows: int, multiple: int) -> TeraPipePlan:
    """A random plan for PP=2: one chunk or two per rank, or edge slicing."""
    V = rng.choice([1, 2])
    if V == 1 and rng.random() < 0.25:
        return draw_edge_plan(rng, 2, M, rows, multiple)
    units = SEQ // multiple
    slices = [u * multiple for u in composition(rng, units, rng.randint(1, min(4, units)))]
    plan = TeraPipePlan(slices, order=rng.choice(["1f1b", "gpipe"]),
                        defer_wgrad=rng.random() < 0.8, virtual_stages=V)
    if plan.defer_wgrad and rng.random() < 0.5:
        plan = replace(plan, wgrad_after=w_places(rng, plan, M, 2, rows))
    return plan


def _case(rng: random.Random, name: str, world: int) -> MoECase:
    M, rows = rng.randint(1, 5), rng.choice([1, 2])
    layout: dict = {}
    if world == 4 and rng.random() < 0.5:
        layout = dict(ep=rng.choice([1, 2]), ddp=True)  # DP=2 x PP=2
    elif world == 4:
        # DDP's finalize_model_grads all-reduces the sequence-parallel norms' and routers'
        # gradients over TP; without it each rank's partial sums depend on the token split
        layout = dict(tp=2, ddp=True)
    parallel = layout.get("tp") == 2  # Megatron refuses MoE with TP but no sequence parallelism
    model = draw_model(rng, sequence_parallel=parallel)
    plan = draw_plan(rng, M, rows, 2 if parallel else 1)
    # No padding masks under sequence parallelism (Megatron's GPTModel splits them on the first
    # stage only: test_moe_losses.py) or with expert bias (Megatron's _apply_expert_bias
    # cannot broadcast one: its own run fails).
    padding = not (parallel or model.expert_bias) and rng.random() < 0.3
    return MoECase(name, plan, model=model, num_microbatches=M, micro_batch_size=rows,
                   padding=padding, **layout)


CASES_2 = random_cases(_case, 2, max(1, RUNS // 2), SEED, stream=1000, prefix="random_moe")
CASES_4 = random_cases(_case, 4, max(1, RUNS // 3), SEED, stream=1000, prefix="random_moe")

#: The runs need a megatron-core line whose router TeraPipe reproduces (test_moe_losses.py).
pytestmark = pytest.mark.skipif(router_versions.line_problem() is not None,
                                reason="TeraPipe refuses MoE router losses on this megatron-core")


#: What the world2 / world4 fixtures run (conftest.py): WORKER on each world's cases.
WORKER = "harness.runs.moe_runs:run_moe_cases"
WORLDS = {2: CASES_2, 4: CASES_4}


@pytest.mark.parametrize("case", CASES_2, ids=[c.name for c in CASES_2])
def test_random_moe_runs_on_two_processes(world2, case):
    check_moe_case(world2, case)


@pytest.mark.parametrize("case", CASES_4, ids=[c.name for c in CASES_4])
def test_random_moe_runs_on_four_processes(world4, case):
    check_moe_case(world4, case)
