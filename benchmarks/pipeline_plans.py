"""The cost model and the plans a pipeline benchmark times: a layer profile measured here
(`profile_cost_model`), the planner's own plan beside the best uniform slicing (`plans_for`),
Megatron's 1F1B as the simulator times it, and the simulated time of each. Shared by the
benchmarks that run the rows (pipeline_runs.py) and those that only re-plan or re-simulate."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from harness import TinyGPT
from megatron_terapipe.plan import TeraPipePlan


def profile_cost_model(model: TinyGPT, granularity: int, layers_per_stage: int, device: str,
                       cache: Optional[str], dtype: str = "float32", statistic: str = "min",
                       repeats: int = 3, link=None, timing: str = "wall"):
    """A ProfiledCostModel of one layer of `model` measured here (cached in `cache`), with the
    first stage's embedding and the last stage's output layer and loss measured too; each
    time the `statistic` (min or median) of `repeats` runs. `link`: the stage-to-stage Link,
    e.g. measured (bench_gpu_pipeline.measured_link); else a loopback estimate. `timing`: the
    measurement's clock (measure/clocks.py; "device": what a CUDA-graphed cell costs)."""
    from megatron_terapipe.megatron.measure.layers import measure_layer_times
    from megatron_terapipe.megatron.measure.edges import edge_points_for, measure_edge_times
    from megatron_terapipe.planner import (EdgeTimeFit, LayerTimeFit, ModelDims, ProfiledCostModel,
                                           fit_edge_times, fit_layer_times)
    from megatron_terapipe.planner.cost.dims import Link
    from megatron_terapipe.planner.profile.time_samples import default_grid

    dims = ModelDims(num_layers=model.num_layers, hidden_size=model.hidden_size,
                     num_attention_heads=model.num_attention_heads, vocab_size=model.vocab_size)
    measure = dict(dtype=dtype, device=device, repeats=repeats, statistic=statistic, timing=timing)

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
            elif fit.metadata.get("timing", "wall") != timing:
                print(f"  the cached profile was timed {fit.metadata.get('timing', 'wall')!r}, not "
                      f"{timing!r}: measuring again")
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
    if link is None:  # stage-to-stage transfers stay on this host: loopback estimates
        link = Link(bandwidth=5e9, latency=50e-6) if device == "cpu" else Link(bandwidth=100e9, latency=10e-6)
    return ProfiledCostModel(fit, layers_per_stage=layers_per_stage, link=link, model=dims,
                             dtype_bytes=2 if dtype == "bfloat16" else 4)


def plans_for(cost, model: TinyGPT, num_microbatches: int, granularity: int,
              stages: int) -> tuple[dict, dict]:
    """Megatron (None), the DP plan (better order by simulation) and the best uniform slicing."""
    from megatron_terapipe.planner import best_uniform_slicing, place_wgrad_points, solve
    from megatron_terapipe.planner.evaluate.simulator import plan_time

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


def w_placed_plans(plans: dict, cost, case) -> dict:
    """The DP plan again with its W actions placed by the planner (`plan_wgrad`, simulated on
    the case's profile; `case`: a bench_gpu_pipeline.GpuCase), as "terapipe_dp_w_placed"; none where the default places are as fast
    (plan_wgrad then keeps them: the row would repeat the DP's)."""
    from megatron_terapipe.planner.wgrad_slots import plan_wgrad

    dp = plans["terapipe_dp"]
    if not dp.defer_wgrad:
        return {}
    placed, seconds = plan_wgrad(dp, cost, case.num_microbatches, case.stages, 1)
    if not placed.wgrad_after:
        return {}
    return {"terapipe_dp_w_placed": replace(placed, predicted_time=seconds)}


def megatron_1f1b_plan(model: TinyGPT) -> TeraPipePlan:
    """Megatron's 1F1B as the simulator times it (as the planner's schedule table does): the
    1f1b order, one slice, weight gradients inside each backward (Megatron defers none)."""
    return TeraPipePlan([model.seq_length], order="1f1b", defer_wgrad=False)


def predict(cost, plan: Optional[TeraPipePlan], model: TinyGPT, num_microbatches: int,
            cores: float, stages: int) -> float:
    """Simulated iteration time; None: Megatron's 1F1B (`megatron_1f1b_plan`)."""
    from megatron_terapipe.planner.evaluate.simulator import plan_time

    plan = megatron_1f1b_plan(model) if plan is None else plan
    return plan_time(plan, cost, num_microbatches, stages, 1, cores)
