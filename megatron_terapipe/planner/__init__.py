"""Planning: cost models, the exact DP slicer, the plan search and the schedule simulator
(numpy only; nothing here imports torch or Megatron).

    from megatron_terapipe.planner import AnalyticCostModel, model_preset, hardware_preset, solve
    cost = AnalyticCostModel(model_preset("gpt3-13b"), hardware_preset("v100"), layers_per_stage=5)
    plan = solve(cost, seq_length=2048, micro_batch_size=1, num_stages=8)

Folders and modules, in the order they build on each other: cost/ (the CostModel interface,
model and GPU shapes, the analytic model, a stage's memory), profile/ (measured time samples and
memory, their fits, the profiled cost model), evaluate/ (the timing and memory replays of the
schedule's action lists: simulator, memory_walk, list_estimate, calibration); slicer (the DP),
hill_climb (simulator-guided refinement of a plan's slices), search (the one plan search),
memory_search (within a budget), wgrad_slots (where W actions run, by list scheduling),
edge_search (finer slices at the pipeline's fill and drain), virtual_search (plans on virtual
stages: V model chunks per rank), schedule_choice (Megatron's schedules vs TeraPipe's), inputs
(PlannerInputs: what every question to the planner starts from); cli/ (terapipe-plan, its
tables and timelines).

May import: plan, schedule, planner
"""

from .cost.analytic import AnalyticCostModel
from .cost.cost_model import CostModel, FunctionCostModel
from .cost.dims import Hardware, LayerMemory, Link, ModelDims
from .cost.presets import HARDWARE_PRESETS, MODEL_PRESETS, hardware_preset, model_preset
from .evaluate.simulator import SimulationResult, plan_time, simulate, simulate_plan
from .hill_climb import fewer_cells, place_wgrad_points, refine
from .profile.profiled_cost import ProfiledCostModel
from .profile.time_fit import EdgeTimeFit, LayerTimeFit
from .profile.least_squares import fit_edge_times, fit_layer_times
from .profile.time_samples import EdgeMeasurements, LayerMeasurements, default_grid
from .search import SearchResult, SearchSpace, search, solve
from .slicer import SlicingSolution, best_uniform_slicing, plan_objective, solve_slicing
from .cli.timeline import chrome_trace, write_chrome_trace, write_png
from .virtual_search import search_virtual
from .wgrad_slots import place_wgrad, plan_wgrad

__all__ = [
    "AnalyticCostModel",
    "CostModel",
    "EdgeMeasurements",
    "EdgeTimeFit",
    "FunctionCostModel",
    "HARDWARE_PRESETS",
    "Hardware",
    "LayerMeasurements",
    "LayerMemory",
    "LayerTimeFit",
    "Link",
    "MODEL_PRESETS",
    "ModelDims",
    "ProfiledCostModel",
    "SearchResult",
    "SearchSpace",
    "SimulationResult",
    "SlicingSolution",
    "best_uniform_slicing",
    "chrome_trace",
    "default_grid",
    "fewer_cells",
    "fit_edge_times",
    "fit_layer_times",
    "hardware_preset",
    "model_preset",
    "place_wgrad",
    "place_wgrad_points",
    "plan_wgrad",
    "plan_objective",
    "plan_time",
    "refine",
    "search",
    "search_virtual",
    "simulate",
    "simulate_plan",
    "solve",
    "solve_slicing",
    "write_chrome_trace",
    "write_png",
]
