"""What a stage checks and sorts out before its executor runs (runtime/executor.py): the
schedule lowered for its transport, the transport and graphs a V of chunks needs, and one
model and data source per model chunk."""

from __future__ import annotations

from typing import Optional, Union

from ..schedule import LoweredSchedule, Schedule
from .batching import CellData
from .graphs.cell_graphs import CellGraphs
from .comm.transport import Transport


def lowered_for(schedule: Union[LoweredSchedule, Schedule],
                transport: Transport) -> LoweredSchedule:
    """The lowered schedule the transport can run: another transport's lowering would post or
    fuse receives this one does not make, and hang."""
    if not isinstance(schedule, LoweredSchedule):
        return LoweredSchedule.of(schedule, transport.lowering)
    if schedule.lowering != transport.lowering:
        raise ValueError(
            f"TeraPipe: the schedule was lowered for {schedule.lowering} but the stage's "
            f"transport ({type(transport).__name__}) runs {transport.lowering}: lower it for "
            "the transport (build_lowered_schedule(..., lowering=transport.lowering))")
    return schedule


def check_v_shape(schedule: Schedule, transport: Transport,
                  graphs: Optional[CellGraphs]) -> None:
    """A V of model chunks runs on a transport that carries its routes, without CUDA graphs."""
    if schedule.plan.virtual_placement != "v":
        return
    if not transport.runs_v_shape:
        raise ValueError(
            f"TeraPipe: a plan with virtual_placement 'v' sends chunk 1's messages back up "
            f"the ranks, which {type(transport).__name__} does not carry: use the torch "
            "transport (TeraPipeConfig.transport 'torch' or 'host')")
    if graphs is not None:
        raise ValueError("TeraPipe: a plan with virtual_placement 'v' runs without CUDA graphs: "
                         "unset TeraPipeConfig.cuda_graphs (--terapipe-cuda-graphs)")


def per_chunk(schedule: Schedule, model, data) -> tuple[list, list[CellData]]:
    """The StageModel (executor.py) and CellData of every model chunk, one per chunk of the plan."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    chunk_data = list(data) if isinstance(data, (list, tuple)) else [data]
    V = schedule.num_chunks
    if len(models) != V or len(chunk_data) != V:
        raise ValueError(
            f"TeraPipe: the plan runs {V} model chunks per stage (virtual_stages) but the stage "
            f"got {len(models)} models and {len(chunk_data)} data sources: give one of each "
            "per chunk, or a plan with virtual_stages equal to the model chunks")
    return models, chunk_data
