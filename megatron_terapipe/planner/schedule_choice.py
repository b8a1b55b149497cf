"""Which pipeline schedule to run: Megatron's 1F1B, Megatron's interleaved 1F1B with each
number of model chunks that divides a stage's layers, and TeraPipe with its best plan in each
order (and, for each chunk count in `SearchSpace.virtual_stages` that divides a stage's
layers, on that many virtual stages per rank: virtual_search.py), all timed by the same cost
model on their action lists (the simulator) and held against the same memory budget. `compare_schedules` makes the table terapipe-plan prints;
`ScheduleTable.auto` is what `--pipeline-schedule auto` runs: the fastest schedule that fits,
except that TeraPipe must be predicted at least AUTO_MIN_GAIN faster than Megatron's best,
or Megatron's schedule runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from ..plan import TeraPipePlan, v_chunk_layers
from ..schedule import build_interleaved_schedule, build_schedule
from ..schedule.orders import order_names
from .cost.cost_model import CostModel
from .cost.stage_memory import MemoryBudget, MemoryBudgetError
from .evaluate.simulator import SimulationResult, simulate
from .memory_search import search_within_budget
from .search import Candidate, SearchResult, SearchSpace
from .virtual_search import VirtualSearchResult, search_virtual

#: TeraPipe must be predicted at least this much faster than Megatron's best schedule.
AUTO_MIN_GAIN = 0.03
MEGATRON, TERAPIPE = "megatron", "terapipe"


@dataclass(frozen=True)
class ScheduleOption:
    """One row of the table: a schedule, its prediction, and whether it fits."""

    name: str  # "TeraPipe 1f1b", "Megatron 1F1B", "Megatron interleaved, 2 chunks"
    family: str  # MEGATRON or TERAPIPE
    order: str  # "1f1b" or "gpipe" (Megatron's schedules: "1f1b")
    num_chunks: int = 1  # model chunks per stage (interleaved: 2 or more)
    result: Optional[SimulationResult] = None  # None: the schedule cannot run this shape
    totals: tuple[float, ...] = ()  # predicted peak per stage, model state included
    fits: bool = False
    plan: Optional[TeraPipePlan] = None  # TeraPipe's plan
    note: str = ""  # the plan in brief ("8 slices +W"), "does not fit", or why it cannot run
    placement: str = "ring"  # where TeraPipe's chunks sit: Megatron's ring, or "v" (2 chunks)

    @property
    def time(self) -> Optional[float]:
        return None if self.result is None else self.result.iteration_time

    @property
    def runnable(self) -> bool:
        return self.result is not None


@dataclass(frozen=True)
class AutoChoice:
    """What `--pipeline-schedule auto` runs, the runner-up and the predicted margin."""

    chosen: ScheduleOption
    runner_up: Optional[ScheduleOption]
    margin: Optional[float]  # runner-up time / chosen time - 1
    reason: str


@dataclass(frozen=True)
class ScheduleTable:
    options: tuple[ScheduleOption, ...]  # fitting ones fastest first, then the rest
    budget: MemoryBudget

    def best(self, family: Optional[str] = None) -> Optional[ScheduleOption]:
        """The fastest option that fits (of one family)."""
        return next((o for o in self.options if o.fits and (family is None or o.family == family)),
                    None)

    def auto(self, min_gain: float = AUTO_MIN_GAIN) -> AutoChoice:
        """The fastest schedule that fits; TeraPipe only if at least `min_gain` faster than
        Megatron's best. Raises MemoryBudgetError when nothing fits."""
        best = self.best()
        if best is None:
            raise MemoryBudgetError(
                "no pipeline schedule fits the memory budget: " + "; ".join(
                    f"{o.name}: {o.note}" for o in self.options))
        megatron, terapipe = self.best(MEGATRON), self.best(TERAPIPE)
        if best.family == TERAPIPE and megatron is None:  # the runner-up may not fit
            megatron = next((o for o in self.options if o.family == MEGATRON and o.runnable), None)
            if megatron is not None:
                return AutoChoice(best, megatron, megatron.time / best.time - 1.0,
                                  "Megatron's schedules do not fit the memory budget")
        if best.family == TERAPIPE and megatron is not None:
            if best.time > megatron.time * (1.0 - min_gain):
                return AutoChoice(megatron, best, best.time / megatron.time - 1.0,
                                  f"TeraPipe is not predicted at least {100 * min_gain:.0f}% "
                                  f"faster than Megatron's best schedule")
            return AutoChoice(best, megatron, megatron.time / best.time - 1.0,
                              "the fastest schedule that fits")
        runner = terapipe if best.family == MEGATRON and terapipe is not None else next(
            (o for o in self.options if o.runnable and o is not best), None)
        margin = None if runner is None else runner.time / best.time - 1.0
        return AutoChoice(best, runner, margin, "the fastest schedule that fits")


def interleaved_chunk_counts(layers_per_stage: int) -> list[int]:
    """Model chunks per stage that divide its layers (2 or more)."""
    return [v for v in range(2, layers_per_stage + 1) if layers_per_stage % v == 0]


def _megatron_options(cost_model: CostModel, space: SearchSpace, budget: MemoryBudget,
                      layers_per_stage: int) -> list[ScheduleOption]:
    K, M = space.num_stages, space.num_microbatches
    whole = TeraPipePlan([space.seq_length], order="1f1b", defer_wgrad=False)
    schedules = [("Megatron 1F1B", 1, lambda: build_schedule(whole, M, K, space.micro_batch_size))]
    for v in interleaved_chunk_counts(layers_per_stage):
        schedules.append((f"Megatron interleaved, {v} chunks", v,
                          lambda v=v: build_interleaved_schedule(space.seq_length, M, K, v,
                                                                  space.micro_batch_size,
                                                                  space.microbatch_group)))
    out = []
    for name, chunks, build in schedules:
        try:
            schedule = build()
        except ValueError as exc:  # Megatron's own conditions (e.g. microbatches per group)
            out.append(ScheduleOption(name, MEGATRON, "1f1b", chunks, note=f"cannot run: {exc}"))
            continue
        # Megatron's own schedules send whole messages (scatter-gather is TeraPipe's)
        result = simulate(schedule, cost_model.without_scatter_gather(), memory=space.memory,
                          megatron=True)
        out.append(_option(name, MEGATRON, "1f1b", chunks, result, budget, None, ""))
    return out


def _option(name, family, order, chunks, result, budget, plan, note) -> ScheduleOption:
    totals = budget.totals(result.peak_memory_bytes)
    fits = budget.fits(result.peak_memory_bytes)
    return ScheduleOption(name, family, order, chunks, result, totals, fits, plan,
                          note if fits else (note + "; " if note else "") + "does not fit")


#: A search for one order within the budget (raises MemoryBudgetError as search_within_budget).
OrderSearch = Callable[[str], SearchResult]
#: A search for one order on V chunks per stage, round the ring or in a V (raises as
#: search_virtual).
VirtualSearch = Callable[[str, int, str], VirtualSearchResult]


def terapipe_row_name(order: str, chunks: int, placement: str = "ring") -> str:
    """'TeraPipe 1f1b', 'TeraPipe gpipe, 4 chunks', 'TeraPipe 1f1b, 2 chunks in a V'."""
    return (f"TeraPipe {order}" + (f", {chunks} chunks" if chunks > 1 else "")
            + (" in a V" if placement == "v" else ""))


def _terapipe_option(order: str, chunks: int, search: Callable[[], object],
                     budget: MemoryBudget, placement: str = "ring") -> ScheduleOption:
    name = terapipe_row_name(order, chunks, placement)
    lean = ""
    try:
        chosen: Candidate = search().chosen  # type: ignore[attr-defined]
    except MemoryBudgetError as exc:  # the leanest plan found, marked as not fitting
        chosen, lean = exc.leanest, "leanest: "  # type: ignore[attr-defined]
    except ValueError as exc:  # virtual stages this run cannot have
        if chunks == 1:
            raise
        return ScheduleOption(name, TERAPIPE, order, chunks, note=f"cannot run: {exc}",
                              placement=placement)
    return replace(_option(name, TERAPIPE, order, chunks, chosen.result, budget, chosen.plan,
                           lean + plan_note(chosen.plan)), placement=placement)


def merge_same_schedules(options: list[ScheduleOption]) -> list[ScheduleOption]:
    """One row per schedule: a TeraPipe option whose plan lays out the same actions on every
    stage as an earlier one's (1f1b and gpipe on one microbatch: every forward, then every
    backward) is left out, and the row kept names its order too. Timed as two rows, one
    schedule measured 16% apart from itself on the 2-core CPU
    (benchmarks/results/cpu/auto_twins.json)."""
    kept: list[ScheduleOption] = []
    layouts: dict[tuple, int] = {}
    for option in options:
        if option.family != TERAPIPE or option.result is None:
            kept.append(option)
            continue
        # the lists the simulator timed for this row
        layout = tuple(tuple((a.kind, a.cell) for a in stage)
                       for stage in option.result.schedule.stages)
        if layout in layouts:
            i = layouts[layout]
            kept[i] = replace(kept[i], note=f"{kept[i].note}; {option.order}: the same actions")
            continue
        layouts[layout] = len(kept)
        kept.append(option)
    return kept


def plan_note(plan: TeraPipePlan) -> str:
    """A TeraPipe plan in brief: '3 slices x 2 batch slices +W, W placed, groups of 4'
    (virtual stages: microbatches per group, and a shorter warm-up when it has one)."""
    n = len(plan.seq_slices)
    note = f"{n} slice{'s' if n > 1 else ''}" + (
        f" x {plan.num_batch_slices} batch slices" if plan.num_batch_slices > 1 else "") + (
        " +W" if plan.defer_wgrad else "")
    note += ", early W" if plan.wgrad_points else ""
    note += "".join(f", {w} {n} cut in {len(ts)}" for w, (n, ts) in zip(("first", "last"),
                                                                         plan.edge_slices) if n)
    note += ", W placed" if plan.wgrad_after else ""
    note += f", groups of {plan.virtual_group}" if plan.virtual_group else ""
    if plan.virtual_placement == "v":  # its warm-up: units in flight beyond K + C - 1
        lead = plan.virtual_warmup
        return note + ", in a V" + (f", lead {lead}" if lead is not None else "")
    return note + (f", warm-up {plan.virtual_warmup}" if plan.virtual_warmup is not None else "")


def virtual_chunk_counts(space: SearchSpace, layers_per_stage: int) -> list[int]:
    """The space's chunk counts (besides 1) that divide a stage's layers, on 2 or more stages."""
    if space.num_stages < 2:
        return []
    return [v for v in space.virtual_stages if v > 1 and layers_per_stage % v == 0]


def v_chunks_open(space: SearchSpace, layers_per_stage: int) -> bool:
    """Whether a V's 2 chunks are open: on 2 or more stages of 2 or more layers, where the
    space allows 2 chunks, or allows chunks at all on a stage of odd layers (the V's chunks
    need not be equal, plan.v_chunk_layers, while the ring's must divide the stage)."""
    return (space.num_stages >= 2 and layers_per_stage >= 2
            and (2 in space.virtual_stages
                 or (bool(space.virtual_stages) and layers_per_stage % 2 == 1)))


def compare_schedules(cost_model: CostModel, space: SearchSpace, budget: MemoryBudget,
                      layers_per_stage: int, orders: Optional[Sequence[str]] = None,
                      search: Optional[OrderSearch] = None,
                      virtual: Optional[VirtualSearch] = None,
                      progress: Optional[Callable[[str], None]] = None,
                      v_rows: bool = False) -> ScheduleTable:
    """Every candidate schedule for the run `space` describes, timed and held against
    `budget`: fitting ones fastest first, then those that do not fit (fastest first), then
    those that cannot run. `orders`: TeraPipe's orders to try (default: every registered
    one, schedule/orders.py). `search`: TeraPipe's plan search per order (default:
    search_within_budget; PlannerInputs passes the searches it already made); `virtual`:
    its search per order on V chunks per stage, for V in `virtual_chunk_counts` (default:
    search_virtual, started from the order's one-chunk plan). `progress`: called with each
    TeraPipe row's name and count ("TeraPipe 1f1b, 5 chunks (2 of 4)") before its search.
    `v_rows`: also each order on 2 chunks in a V (Zero Bubble's ZB-V placement), where the
    space allows 2 chunks and fixes no microbatch group (the interleaved order's)."""
    if search is None:
        def search(order: str) -> SearchResult:
            return search_within_budget(cost_model, replace(space, order=order), budget)
    if virtual is None:
        def virtual(order: str, chunks: int, placement: str = "ring") -> VirtualSearchResult:
            try:
                hint = search(order).plan
            except MemoryBudgetError:
                hint = None
            layers = v_chunk_layers(layers_per_stage) if placement == "v" else ()
            return search_virtual(cost_model, replace(space, order=order), budget, chunks, hint,
                                  placement, layers)
    options = _megatron_options(cost_model, space, budget, layers_per_stage)
    # a V holds 2 chunks: where the space allows 2 (of unequal layers where a stage's are
    # odd, plan.v_chunk_layers), and no interleaved group is fixed
    in_v = (v_rows and v_chunks_open(space, layers_per_stage)
            and space.microbatch_group is None)
    rows = [(order, v, "ring") for order in (order_names() if orders is None else orders)
            for v in (1, *virtual_chunk_counts(space, layers_per_stage))]
    rows += [(order, 2, "v") for order in (order_names() if orders is None else orders) if in_v]
    for i, (order, v, where) in enumerate(rows):
        if progress is not None:
            progress(f"{terapipe_row_name(order, v, where)} ({i + 1} of {len(rows)})")
        run = ((lambda o=order: search(o)) if v == 1 else
               (lambda o=order, v=v, w=where: virtual(o, v, w)))
        options.append(_terapipe_option(order, v, run, budget, where))
    options = merge_same_schedules(options)
    # times within a microsecond tie: the one that keeps less goes first
    ranked = sorted(options, key=lambda o: (not o.runnable, not o.fits,
                                            round((o.time or 0.0) * 1e6),
                                            max(o.totals, default=0.0)))
    return ScheduleTable(tuple(ranked), budget)
