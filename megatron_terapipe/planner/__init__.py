"""Planning: cost models, the exact DP slicer, the plan search and the schedule simulator
(numpy only; nothing here imports torch or Megatron).

    from megatron_terapipe.planner import AnalyticCostModel, model_preset, hardware_preset, solve
    cost = AnalyticCostModel(model_preset("gpt3-13b"), hardware_preset("v100"), layers_per_stage=5)
    plan = solve(cost, seq_length=2048, micro_batch_size=1, num_stages=8)

Modules, in the order they build on each other: arrays, cost_model (the CostModel interface),
dims (model, link and GPU shapes), layer_stack, analytic, measurements, fits, fitting, profiled,
presets; slicer (the DP), simulator, refine, search (the one plan search), report, trace, cli.
"""

from .analytic import AnalyticCostModel
from .cost_model import CostModel, FunctionCostModel
from .dims import Hardware, LayerMemory, Link, ModelDims
from .fits import EdgeTimeFit, LayerTimeFit
from .fitting import fit_edge_times, fit_layer_times
from .measurements import EdgeMeasurements, LayerMeasurements, default_grid
from .presets import HARDWARE_PRESETS, MODEL_PRESETS, hardware_preset, model_preset
from .profiled import ProfiledCostModel
from .refine import fewer_cells, place_wgrad_points, refine
from .search import SearchResult, SearchSpace, search, solve
from .simulator import SimulationResult, plan_time, simulate, simulate_plan
from .slicer import SlicingSolution, best_uniform_slicing, plan_objective, solve_slicing
from .trace import chrome_trace, write_chrome_trace, write_png

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
    "place_wgrad_points",
    "plan_objective",
    "plan_time",
    "refine",
    "search",
    "simulate",
    "simulate_plan",
    "solve",
    "solve_slicing",
    "write_chrome_trace",
    "write_png",
]
