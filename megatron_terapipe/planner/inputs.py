"""PlannerInputs: everything a question to the planner starts from (the model, the cost model,
the run's search space with its stage memory, the memory budget), and the builders both of its
adapters share. It has exactly two adapters, one per way of asking: terapipe-plan's options
(cli/arguments.py) and Megatron-LM's flags (megatron/args/inputs_from_flags.py). Everything that plans,
compares schedules or predicts memory takes a PlannerInputs, so the same configuration asked
either way gets the same plan (tests/planner/cli/test_planner_inputs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from ..plan import TeraPipePlan, v_chunk_layers
from .cost.analytic import AnalyticCostModel
from .cost.cost_model import CostModel
from .cost.dims import Hardware, ModelDims
from .cost.recompute_time import FullRecompute
from .cost.recompute_memory import with_recompute
from .cost.stage_memory import (MemoryBudget, MemoryBudgetError, ModelStateConfig, StageMemory,
                                model_state_bytes)
from .memory_search import search_within_budget
from .schedule_choice import ScheduleTable, compare_schedules
from .search import SearchResult, SearchSpace, pipeline_link
from .virtual_search import VirtualSearchResult, search_virtual


@dataclass
class PlannerInputs:
    """One run, as the planner sees it."""

    model: ModelDims
    cost_model: CostModel
    space: SearchSpace  # the run's shape, the choices open to the search, the stage memory
    budget: MemoryBudget  # per GPU (None: no limit), with the model state per stage
    notes: list[str] = field(default_factory=list)  # guesses made on the way, for the log
    # an uneven split's busiest stage's layers, which every stage is priced as (None: even)
    busiest_layers: Optional[int] = None
    _searches: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def layers_per_stage(self) -> int:
        return priced_layers(self.model, self.space.num_stages, self.busiest_layers)

    def search(self, order: Optional[str] = None) -> SearchResult:
        """The plan search in `order` (default: the space's), within the budget when there is
        one (raises MemoryBudgetError). Made once per order: the schedule table asks again."""
        order = order or self.space.order
        return self._once(order, lambda: search_within_budget(
            self.cost_model, replace(self.space, order=order), self.budget))

    def search_virtual(self, order: str, chunks: int,
                       placement: str = "ring") -> VirtualSearchResult:
        """The plan search in `order` on `chunks` model chunks per stage placed round the ring
        or in a V (virtual_search.py), started from the order's one-chunk plan; made once per
        (order, chunks, placement)."""
        def run() -> VirtualSearchResult:
            try:
                hint: Optional[TeraPipePlan] = self.search(order).plan
            except MemoryBudgetError:
                hint = None
            layers = v_chunk_layers(self.layers_per_stage) if placement == "v" else ()
            return search_virtual(self.cost_model, replace(self.space, order=order), self.budget,
                                  chunks, hint, placement, layers)

        return self._once((order, chunks, placement), run)

    def _once(self, key, make: Callable[[], object]):
        """`make()`'s result for `key`, computed once; a MemoryBudgetError is kept and raised
        again on every later ask."""
        if key not in self._searches:
            try:
                self._searches[key] = make()
            except MemoryBudgetError as error:
                self._searches[key] = error
        found = self._searches[key]
        if isinstance(found, MemoryBudgetError):
            raise found
        return found

    def schedule_table(self, interleaved: bool = True,
                       progress: Optional[Callable[[str], None]] = None,
                       v_rows: bool = False) -> ScheduleTable:
        """Megatron's schedules and TeraPipe's, timed and held against the budget;
        interleaved: whether Megatron's interleaved 1F1B is open to the run (TeraPipe on
        virtual stages is open where the space's virtual_stages says); progress: told each
        TeraPipe row before its search; v_rows: TeraPipe on 2 chunks in a V too
        (compare_schedules)."""
        return compare_schedules(self.cost_model, self.space, self.budget,
                                 self.layers_per_stage if interleaved else 1, search=self.search,
                                 virtual=self.search_virtual, progress=progress,
                                 v_rows=v_rows and interleaved)


def priced_layers(model: ModelDims, num_stages: int, busiest_layers: Optional[int] = None) -> int:
    """The layers the planner prices every stage as: `busiest_layers` (the busiest stage of an
    uneven split: the pipeline's pace), else the even split's."""
    return busiest_layers if busiest_layers is not None else model.num_layers // num_stages


def layer_cost_model(model: ModelDims, hardware: Hardware, num_stages: int, *,
                     tensor_parallel: int, dtype_bytes: int, cross_nodes: bool,
                     profile_path: Optional[str] = None, fit=None,
                     busiest_layers: Optional[int] = None,
                     sequence_parallel: bool = False, scatter_gather: bool = False,
                     recompute: Optional[FullRecompute] = None) -> CostModel:
    """The analytic model of `hardware`, or the profiled one from a layer fit (`fit`, or the
    file at `profile_path`); stage-to-stage links as `search.pipeline_link`; activations and
    P2P messages split over the TP ranks under `sequence_parallel`; `scatter_gather`: TeraPipe's
    messages sent in TP parts and gathered over the node's link (Megatron's schedules are
    priced with whole messages); `recompute`: Megatron's full recomputation, whose rerun
    forwards every backward pays (on both sides). Raises ValueError on a profile that does not
    fit the model (the adapters name their option)."""
    cost = _layer_cost_model(model, hardware, num_stages, tensor_parallel=tensor_parallel,
                             dtype_bytes=dtype_bytes, cross_nodes=cross_nodes,
                             profile_path=profile_path, fit=fit, busiest_layers=busiest_layers,
                             sequence_parallel=sequence_parallel)
    cost = cost.with_recompute(recompute) if recompute is not None else cost
    return cost.with_scatter_gather(hardware.intra_node) if scatter_gather else cost


def _layer_cost_model(model: ModelDims, hardware: Hardware, num_stages: int, *,
                      tensor_parallel: int, dtype_bytes: int, cross_nodes: bool,
                      profile_path: Optional[str], fit, busiest_layers: Optional[int],
                      sequence_parallel: bool):
    layers = priced_layers(model, num_stages, busiest_layers)
    if fit is None and profile_path is None:
        return AnalyticCostModel(model, hardware, layers, tensor_parallel=tensor_parallel,
                                 dtype_bytes=dtype_bytes, inter_node=cross_nodes,
                                 sequence_parallel=sequence_parallel)
    from .profile.profiled_cost import ProfiledCostModel

    link = pipeline_link(hardware, cross_nodes)
    if fit is not None:
        return ProfiledCostModel(fit, layers, link, model=model, tensor_parallel=tensor_parallel,
                                 dtype_bytes=dtype_bytes, sequence_parallel=sequence_parallel)
    return ProfiledCostModel.load(profile_path, layers, link, model=model,
                                  tensor_parallel=tensor_parallel, dtype_bytes=dtype_bytes,
                                  sequence_parallel=sequence_parallel)


def memory_budget(model: ModelDims, num_stages: int, budget_bytes: Optional[float],
                  model_state: Optional[float], config: ModelStateConfig,
                  busiest_layers: Optional[int] = None) -> MemoryBudget:
    """The budget per GPU, with the model state per stage: `model_state` on every stage when
    given, else Megatron's accounting of this model under `config`."""
    if model_state is not None:
        state = (float(model_state),) * num_stages
    else:
        state = model_state_bytes(model, priced_layers(model, num_stages, busiest_layers),
                                  num_stages, config)
    return MemoryBudget(budget_bytes, state)


def stage_memory(model: ModelDims, num_stages: int, profile_path: Optional[str],
                 busiest_layers: Optional[int] = None, tensor_parallel: int = 1,
                 sequence_parallel: bool = False, recompute: Optional[FullRecompute] = None,
                 dtype_bytes: int = 2) -> Optional[StageMemory]:
    """The measured memory profile at `profile_path` (measured without recomputation; with
    `recompute`, as a run with it keeps: recompute_memory.py), or None (the cost model's
    estimate, which knows its own recomputation). Raises ValueError on a profile that does not
    fit the model or the run's TP layout."""
    if not profile_path:
        return None
    from .profile.memory_fit import FittedMemory

    fitted = FittedMemory.load(profile_path, priced_layers(model, num_stages, busiest_layers), model)
    fitted.check_parallelism(tensor_parallel, sequence_parallel, profile_path)
    split = tensor_parallel if sequence_parallel else 1
    return with_recompute(fitted, recompute, model.hidden_size, dtype_bytes, split)
