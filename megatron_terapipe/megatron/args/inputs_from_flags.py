"""PlannerInputs from Megatron-LM's flags (parsed once, settings.py): the model shape, the GPU
preset and the links between stages, the analytic or profiled cost model, the search space with
its stage memory (--terapipe-memory-profile), and the budget (--terapipe-memory-budget) with the
model state (--terapipe-model-state-memory, or Megatron's accounting from the precision, data
parallelism and --use-distributed-optimizer). terapipe-plan's options are the other adapter
(planner/cli/arguments.py); both build through planner/inputs.py."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from ...planner.cost.dims import Hardware
from ...planner.cost.presets import hardware_preset
from ...planner.inputs import PlannerInputs, layer_cost_model, memory_budget, stage_memory
from ...planner.profile.time_fit import LayerTimeFit
from ...planner.search import SearchSpace, stages_cross_nodes
from .startup_log import WARNING
from .profile_cache import device_name, profile_cache_path
from .settings import RunSettings, RunShape, TeraPipeArgumentError

#: The analytic model's GPU when the device matches no preset (said loudly at start-up).
ASSUMED_HARDWARE = "a100"


def planner_inputs(run: RunSettings, fit: Optional[LayerTimeFit] = None) -> PlannerInputs:
    """What the planner starts from for `run`'s batch. --terapipe-cost-model profile uses
    `fit` (measured), else the cached profile of this shape, else (explicit slices, nothing
    measured yet) the analytic model for the prediction."""
    flags, shape, model = run.terapipe, run.shape, run.require_model()
    hardware, warning = hardware_for(flags.hardware)
    crosses = cross_nodes(shape)
    path = None if flags.cost_model in ("analytic", "profile") else flags.cost_model
    notes = []
    layers = None  # None: the even split's layers per stage
    if run.support.uneven_layers:  # price every stage as the busiest
        layers = run.support.stage_layers.busiest
        notes.append(f"{run.support.uneven_layers}: every stage priced as the busiest, {layers} "
                     "layers")
    if flags.cost_model == "profile" and fit is None:
        cached = profile_cache_path(run)
        if cached.is_file():
            fit = LayerTimeFit.load(cached)
        else:
            notes.append("no measured profile for this shape yet; prediction from the analytic "
                         "model")
    if warning and fit is None and path is None:  # only the analytic model rests on the preset
        notes.insert(0, warning)
    with _named(f"--terapipe-cost-model {path}"):
        cost = layer_cost_model(model, hardware, shape.pipeline_parallel,
                                tensor_parallel=shape.tensor_parallel,
                                dtype_bytes=shape.dtype_bytes, cross_nodes=crosses,
                                profile_path=path, fit=fit, busiest_layers=layers,
                                sequence_parallel=shape.sequence_parallel,
                                scatter_gather=flags.scatter_gather,
                                recompute=shape.full_recompute)
    with _named("--terapipe-memory-profile"):
        memory = stage_memory(model, shape.pipeline_parallel, flags.memory_profile, layers,
                              shape.tensor_parallel, shape.sequence_parallel,
                              shape.full_recompute, shape.dtype_bytes)
    space = SearchSpace(shape.seq_length, shape.micro_batch_size, shape.pipeline_parallel,
                        shape.num_microbatches, order=flags.order, granularity=flags.granularity,
                        multiple_of=shape.tp_multiple, defer_wgrad=flags.defer_wgrad,
                        memory=memory, place_wgrad=flags.wgrad_placement and not shape.rampup,
                        microbatch_group=run.microbatch_group)
    if shape.recompute:
        notes.insert(0, recompute_note(shape))
    if flags.wgrad_placement and shape.rampup:
        notes.append("W actions in their default places: --rampup-batch-size changes the "
                     "microbatch count the places are planned for")
    budget = memory_budget(model, shape.pipeline_parallel, flags.memory_budget,
                           flags.model_state_memory, run.model_state, layers)
    return PlannerInputs(model, cost, space, budget, notes, layers)


def recompute_note(shape: RunShape) -> str:
    """What the planner makes of this run's recomputation: full recomputation is priced (each
    backward's rerun forward, and what the checkpointed groups keep: a note); selective
    recomputation is not (a warning: its times and bytes are left out)."""
    if shape.full_recompute is not None:
        return (f"activation recomputation ({shape.recompute}): predicted times include the "
                "recomputed forwards and memory counts what it keeps (each checkpointed "
                "group's input; a group's activations again during its backward)")
    return (f"{WARNING}activation recomputation ({shape.recompute}) is not modelled: predicted "
            "times leave out the recomputed forwards, and activations are counted as if none "
            "were recomputed (an upper bound: a plan within --terapipe-memory-budget fits, "
            "some refused would fit too)")


def budget_error(exc: object, shape: RunShape) -> TeraPipeArgumentError:
    """A plan that does not fit --terapipe-memory-budget, as the error Megatron-LM's run
    raises; under selective recomputation the bytes are an upper bound, and the error says so."""
    text = f"--terapipe-memory-budget: {exc}"
    if shape.recompute and shape.full_recompute is None:
        text += (f". This run recomputes activations ({shape.recompute}), whose memory saving "
                 "the planner does not model: the bytes above count every activation, so raise "
                 "--terapipe-memory-budget or leave it out")
    return TeraPipeArgumentError(text)


@contextlib.contextmanager
def _named(flag: str) -> Iterator[None]:
    """A profile that does not fit the model (ValueError) as TeraPipeArgumentError naming `flag`."""
    try:
        yield
    except ValueError as exc:
        raise TeraPipeArgumentError(f"{flag}: {exc}") from None


def hardware_for(name: str) -> tuple[Hardware, str]:
    """The analytic model's GPU preset (--terapipe-hardware), and a warning (the report's
    WARNING note) when it is auto and the device name matches none, so a preset is assumed."""
    if name != "auto":
        return hardware_preset(name), ""
    device = device_name().lower()
    for preset in ("h100", "a100", "v100"):
        if preset in device:
            return hardware_preset(preset), ""
    return hardware_preset(ASSUMED_HARDWARE), (
        f"{WARNING}the analytic cost model assumes {ASSUMED_HARDWARE.upper()} GPUs: device "
        f"'{device_name()}' matches no preset; give --terapipe-hardware {{v100,a100,h100}} for "
        "the GPUs the run trains on, or --terapipe-cost-model profile to measure this device")


def cross_nodes(shape: RunShape) -> bool:
    """`search.stages_cross_nodes` for this launch: Megatron's rank order puts the TP, CP and DP
    ranks of a stage between neighbouring stages; a node is LOCAL_WORLD_SIZE ranks."""
    ranks_per_stage = shape.tensor_parallel * shape.context_parallel * shape.data_parallel
    return stages_cross_nodes(ranks_per_stage, shape.pipeline_parallel, shape.ranks_per_node)
