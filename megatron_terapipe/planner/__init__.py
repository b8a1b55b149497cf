"""Planning: cost models, the exact DP slicer and the schedule simulator (numpy only).

    from megatron_terapipe.planner import AnalyticCostModel, model_preset, hardware_preset, solve
    cost = AnalyticCostModel(model_preset("gpt3-13b"), hardware_preset("v100"), layers_per_stage=5)
    plan = solve(cost, seq_length=2048, micro_batch_size=1, num_stages=8)
"""

from .cost_model import (
    AnalyticCostModel,
    CostModel,
    FunctionCostModel,
    Hardware,
    LayerMemory,
    Link,
    ModelDims,
)
from .presets import HARDWARE_PRESETS, MODEL_PRESETS, hardware_preset, model_preset
from .profiled import (
    EdgeMeasurements,
    EdgeTimeFit,
    LayerTimeFit,
    ProfiledCostModel,
    fit_edge_times,
    fit_layer_times,
)
from .refine import fewer_cells, place_wgrad_points, refine
from .simulator import SimulationResult, simulate
from .slicer import SlicingSolution, best_uniform_slicing, plan_objective, solve, solve_slicing
from .trace import chrome_trace, write_chrome_trace, write_png

__all__ = [
    "AnalyticCostModel",
    "CostModel",
    "EdgeMeasurements",
    "EdgeTimeFit",
    "FunctionCostModel",
    "HARDWARE_PRESETS",
    "Hardware",
    "LayerMemory",
    "LayerTimeFit",
    "Link",
    "MODEL_PRESETS",
    "ModelDims",
    "ProfiledCostModel",
    "SimulationResult",
    "refine",
    "SlicingSolution",
    "best_uniform_slicing",
    "chrome_trace",
    "fit_edge_times",
    "fit_layer_times",
    "hardware_preset",
    "model_preset",
    "place_wgrad_points",
    "fewer_cells",
    "plan_objective",
    "simulate",
    "solve",
    "solve_slicing",
    "write_chrome_trace",
    "write_png",
]
