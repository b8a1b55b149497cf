"""The TeraPipe slicer: the exact DP over token slicings, with batch slicing on top.

Objective (TeraPipe paper, extended to M microbatches and batch slices): for the cells of one
microbatch with stage times t_i,

    T = M * sum_i t_i + (K - 1) * max_i u_i

where K is the number of pipeline stages, t_i = the time of cell i (forward + backward) on the
slowest kind of stage, and u_i = t_i + 2 * transfer_time (the hop to the next stage and the gradient's hop back;
u_i = t_i with include_transfer=False). Every cell of every microbatch runs once on every stage
(the sum), and filling and draining the pipeline costs K - 1 hops of the slowest cell (the max).
A cell's time is its layers' slice_time plus the heavier of the cost model's edge times
(`edge_forward_time` / `edge_backward_time`: the embedding on the first stage, the output layer
and the loss on the last), since the slowest stage sets the pace; both edges on one stage.
Zero-edge cost models give the paper's t(l, c). The plan search (search.py) then times plans
with the simulator, which prices every stage with its own edges.

Exact method. For a cap tau on u, S(tau) = least sum over slicings whose cells all have u <= tau:
a DP over prefix lengths per batch size (S_b(n) = min_k S_b(n-k) + t(b, k, n-k)), then a
knapsack over batch sizes that sum to the microbatch's rows. T* = min over tau of
M * S(tau) + (K-1) * tau. S is a non-increasing step function, so we walk the caps downwards:
solving at cap tau gives a plan whose largest u is m <= tau, and that plan is optimal for every
cap in [m, tau]; the next cap is just below m, and also below (best - M * S) / (K - 1), since no
plan with a larger max can beat the best found (S only grows as the cap falls). The walk stops
when M * S + (K - 1) * (smallest feasible cap) reaches the best. Every step is exact, so the
result is the optimum over all slicings in multiples of the granularity; no monotonicity of the
cost model is assumed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from ..plan import SliceGrid, SliceNames, TeraPipePlan
from .cost.cost_model import CostModel

BatchSizes = Union[str, Sequence[int], None]


@dataclass(frozen=True)
class SlicingSolution:
    """What the slicer found, and the figures of its objective."""

    plan: TeraPipePlan
    objective: float  # M * sum + (K-1) * max under the cost model, seconds
    sum_time: float  # sum of t over the cells of one microbatch
    max_time: float  # largest u (t plus transfers) of a cell
    dp_evaluations: int  # capped DPs run
    solve_seconds: float


# ---- objective ------------------------------------------------------------------------------

def bottleneck_cell_time(cost_model: CostModel, batch, length, context, num_stages: int):
    """Seconds of one cell on the pipeline's slowest stage kind: the layers plus the heavier of
    the first stage's (embedding) and the last stage's (output layer + loss) edge time; both
    edges on a one-stage pipeline. Zero-edge cost models give the plain slice time."""
    t = np.asarray(cost_model.slice_time(batch, length, context), dtype=np.float64)

    def edge(first: bool, last: bool):
        return (np.asarray(cost_model.edge_forward_time(batch, length, first, last), dtype=np.float64)
                + np.asarray(cost_model.edge_backward_time(batch, length, first, last), dtype=np.float64))

    if num_stages == 1:
        return t + edge(True, True)
    return t + np.maximum(edge(True, False), edge(False, True))


def cell_arrays(plan: TeraPipePlan, micro_batch_size: int) -> tuple[np.ndarray, ...]:
    """(rows, tokens, context) of every cell of one microbatch under `plan`, as float arrays:
    the cost model's arguments for all of them at once."""
    rows, lengths, contexts = [], [], []
    for r, token_slices in zip(plan.rows(micro_batch_size), plan.token_slices):
        start = 0
        for length in token_slices:
            rows.append(r)
            lengths.append(length)
            contexts.append(start)
            start += length
    return tuple(np.asarray(x, dtype=np.float64) for x in (rows, lengths, contexts))


def plan_objective(plan: TeraPipePlan, cost_model: CostModel, micro_batch_size: int,
                   num_stages: int, num_microbatches: int = 1, include_transfer: bool = True) -> float:
    """The slicer's objective for any plan (what `solve_slicing` minimises)."""
    b, l, c = cell_arrays(plan, micro_batch_size)
    t = bottleneck_cell_time(cost_model, b, l, c, num_stages)
    u = t + 2 * np.asarray(cost_model.transfer_time(b, l)) if include_transfer else t
    return float(num_microbatches * t.sum() + (num_stages - 1) * u.max())


# ---- inputs ---------------------------------------------------------------------------------

def slicing_unit(seq_length: int, granularity: int, multiple_of: int = 1) -> int:
    """Tokens per DP unit: slices are multiples of both the granularity and `multiple_of` (the
    TP size under sequence parallelism); plan.SliceGrid checks that the unit divides the
    sequence."""
    grid = SliceGrid(granularity, multiple_of, names=SliceNames(tensor_parallel="multiple_of"))
    grid.units(seq_length)
    return grid.unit


def resolve_batch_sizes(batch_sizes: BatchSizes, micro_batch_size: int) -> tuple[int, ...]:
    """Allowed rows per batch slice. "divisors" (default): the divisors of the micro batch
    size; "all": 1..micro_batch_size; None or "none": no batch slicing; or a list."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    B = micro_batch_size
    if batch_sizes is None or batch_sizes == "none":
        sizes = [B]
    elif batch_sizes == "divisors":
        sizes = [b for b in range(1, B + 1) if B % b == 0]
    elif batch_sizes == "all":
        sizes = list(range(1, B + 1))
    elif isinstance(batch_sizes, str):
        raise ValueError(f"batch_sizes must be 'divisors', 'all', 'none' or a list of row "
                         f"counts, got {batch_sizes!r}")
    else:
        sizes = sorted({int(b) for b in batch_sizes})
        if not sizes or sizes[0] <= 0 or sizes[-1] > B:
            raise ValueError(f"batch_sizes {list(batch_sizes)} must be row counts in 1..{B}")
    reachable = {0}
    for r in range(1, B + 1):
        if any(r - b in reachable for b in sizes if b <= r):
            reachable.add(r)
    if B not in reachable:
        raise ValueError(f"batch_sizes {sizes} cannot add up to the micro batch size {B}")
    return tuple(sizes)


@dataclass
class _Tables:
    """Cost of every possible cell: [batch size i, end unit n, length units k]."""

    unit: int
    units: int
    batch_sizes: tuple[int, ...]
    sum_cost: np.ndarray  # t; +inf where k == 0 or k > n
    max_cost: np.ndarray  # u = t (+ transfers); +inf likewise


def _cell_tables(cost_model: CostModel, seq_length: int, unit: int, batch_sizes: Sequence[int],
                 include_transfer: bool, num_stages: int = 2) -> _Tables:
    U = seq_length // unit
    n = np.arange(U + 1)[:, None]
    k = np.arange(U + 1)[None, :]
    valid = (k >= 1) & (k <= n)
    length = (k * unit).astype(np.float64)
    context = (np.maximum(n - k, 0) * unit).astype(np.float64)
    b = np.asarray(batch_sizes, dtype=np.float64)[:, None, None]
    t = bottleneck_cell_time(cost_model, b, length, context, num_stages)
    t = np.broadcast_to(t, (len(batch_sizes), U + 1, U + 1))
    if include_transfer:
        x = np.asarray(cost_model.transfer_time(b, length), dtype=np.float64)
        u = t + 2 * x
    else:
        u = t
    sum_cost = np.where(valid, t, np.inf)
    max_cost = np.where(valid, u, np.inf)
    bad = valid & ~(np.isfinite(t) & (t >= 0))
    if bad.any():
        raise ValueError(f"cost model {cost_model.describe()} returned a negative, infinite or "
                         "NaN slice time")
    return _Tables(unit, U, tuple(batch_sizes), np.ascontiguousarray(sum_cost),
                   np.ascontiguousarray(max_cost))


# ---- the capped DP ----------------------------------------------------------------------------

@dataclass
class _Capped:
    """Best plan with every cell's u <= cap."""

    total: float  # sum of t over the microbatch's cells
    max_u: float
    parts: list[tuple[int, list[int]]]  # (rows, token slice lengths in units)


def _token_dp(tables: _Tables, cap: float) -> tuple[np.ndarray, np.ndarray]:
    """S[i, n]: least sum of t to cover n units with batch size i, cells capped at `cap`;
    choice[i, n]: length of the last slice in that optimum."""
    nb, U = len(tables.batch_sizes), tables.units
    S = np.full((nb, U + 1), np.inf)
    S[:, 0] = 0.0
    choice = np.zeros((nb, U + 1), dtype=np.int64)
    rows = np.arange(nb)
    sum_cost, max_cost = tables.sum_cost, tables.max_cost
    for n in range(1, U + 1):
        # vals[:, k-1] = S[n - k] + t(k, n - k) for k = 1..n
        vals = S[:, n - 1::-1] + sum_cost[:, n, 1:n + 1]
        vals[max_cost[:, n, 1:n + 1] > cap] = np.inf
        j = vals.argmin(axis=1)
        S[:, n] = vals[rows, j]
        choice[:, n] = j + 1
    return S, choice


def _backtrack(tables: _Tables, choice: np.ndarray, i: int) -> tuple[list[int], float]:
    n = tables.units
    lengths: list[int] = []
    max_u = 0.0
    while n > 0:
        k = int(choice[i, n])
        max_u = max(max_u, float(tables.max_cost[i, n, k]))
        lengths.append(k)
        n -= k
    lengths.reverse()
    return lengths, max_u


def _solve_capped(tables: _Tables, micro_batch_size: int, cap: float) -> Optional[_Capped]:
    S, choice = _token_dp(tables, cap)
    per_size = S[:, tables.units]
    # knapsack over rows: R[r] = least total over batch slices adding up to r rows
    B = micro_batch_size
    R = np.full(B + 1, np.inf)
    R[0] = 0.0
    pick = np.full(B + 1, -1, dtype=np.int64)
    for r in range(1, B + 1):
        for i, b in enumerate(tables.batch_sizes):
            if b <= r and R[r - b] + per_size[i] < R[r]:
                R[r] = R[r - b] + per_size[i]
                pick[r] = i
    if not np.isfinite(R[B]):
        return None
    parts: list[tuple[int, list[int]]] = []
    max_u = 0.0
    cache: dict[int, tuple[list[int], float]] = {}
    r = B
    while r > 0:
        i = int(pick[r])
        if i not in cache:
            cache[i] = _backtrack(tables, choice, i)
        lengths, m = cache[i]
        parts.append((tables.batch_sizes[i], lengths))
        max_u = max(max_u, m)
        r -= tables.batch_sizes[i]
    return _Capped(float(R[B]), max_u, parts)


def _smallest_feasible_cap(tables: _Tables, micro_batch_size: int) -> float:
    """Least possible max u of any plan (bottleneck DP, then bottleneck knapsack)."""
    nb, U = len(tables.batch_sizes), tables.units
    Bn = np.full((nb, U + 1), np.inf)
    Bn[:, 0] = 0.0
    for n in range(1, U + 1):
        Bn[:, n] = np.maximum(Bn[:, n - 1::-1], tables.max_cost[:, n, 1:n + 1]).min(axis=1)
    per_size = Bn[:, U]
    Q = np.full(micro_batch_size + 1, np.inf)
    Q[0] = 0.0
    for r in range(1, micro_batch_size + 1):
        for i, b in enumerate(tables.batch_sizes):
            if b <= r:
                Q[r] = min(Q[r], max(Q[r - b], per_size[i]))
    return float(Q[micro_batch_size])


def _best_uniform_parts(tables: _Tables, micro_batch_size: int, M: int, K: int) -> Optional[_Capped]:
    """Best plan made of equal batch slices, each cut into n near-equal token slices (None if
    no allowed batch size divides the micro batch size)."""
    U = tables.units
    best: Optional[_Capped] = None
    best_value = np.inf
    for i, b in enumerate(tables.batch_sizes):
        if micro_batch_size % b:
            continue
        copies = micro_batch_size // b
        for n in range(1, U + 1):
            base, extra = divmod(U, n)
            lengths = np.array([base + 1] * extra + [base] * (n - extra))
            ends = np.cumsum(lengths)
            total = copies * float(tables.sum_cost[i, ends, lengths].sum())
            max_u = float(tables.max_cost[i, ends, lengths].max())
            value = M * total + (K - 1) * max_u
            if value < best_value:
                best_value = value
                best = _Capped(total, max_u, [(b, lengths.tolist())] * copies)
    return best


def _plan_from_parts(parts: list[tuple[int, list[int]]], unit: int, order: str,
                     micro_batch_size: int) -> TeraPipePlan:
    parts = sorted(parts, key=lambda p: (-p[0], p[1]))
    token_lists = [[k * unit for k in lengths] for _, lengths in parts]
    if len(parts) == 1:
        return TeraPipePlan(seq_slices=token_lists[0], order=order)
    rows = [r for r, _ in parts]
    if all(ts == token_lists[0] for ts in token_lists):
        return TeraPipePlan(seq_slices=token_lists[0], batch_slices=rows, order=order)
    return TeraPipePlan(seq_slices=token_lists, batch_slices=rows, order=order)


# ---- public entry points --------------------------------------------------------------------

def solve_slicing(cost_model: CostModel, seq_length: int, micro_batch_size: int, num_stages: int,
                  granularity: int = 8, num_microbatches: int = 1, order: str = "1f1b",
                  multiple_of: int = 1, batch_sizes: BatchSizes = "divisors",
                  include_transfer: bool = True) -> SlicingSolution:
    """Exact minimiser of the objective (module docstring) over token slicings in multiples of
    the granularity and batch slicings into the allowed batch sizes."""
    started = time.perf_counter()
    if num_stages <= 0:
        raise ValueError(f"num_stages must be positive, got {num_stages}")
    if num_microbatches <= 0:
        raise ValueError(f"num_microbatches must be positive, got {num_microbatches}")
    unit = slicing_unit(seq_length, granularity, multiple_of)
    sizes = resolve_batch_sizes(batch_sizes, micro_batch_size)
    tables = _cell_tables(cost_model, seq_length, unit, sizes, include_transfer, num_stages)
    M, K = num_microbatches, num_stages

    def objective(sol: _Capped) -> float:
        return M * sol.total + (K - 1) * sol.max_u

    # Start from the better of the least-sum plan and the best uniform plan: a good first bound
    # lets the first cap jump close to the optimum.
    best = _solve_capped(tables, micro_batch_size, np.inf)  # least sum, whatever the max
    assert best is not None  # one slice over the whole batch is always a plan
    current = best
    seed = _best_uniform_parts(tables, micro_batch_size, M, K)
    if seed is not None and objective(seed) < objective(best):
        best = seed
    best_value = objective(best)
    evaluations = 1
    if K > 1:
        floor = _smallest_feasible_cap(tables, micro_batch_size)
        slack = 1e-12 * max(1.0, abs(best_value))
        while True:
            # no plan whose max is >= current.max_u beats `current`; and a plan with max tau
            # needs M * S(tau) + (K-1) tau < best with S(tau) >= current.total
            cap = min(np.nextafter(current.max_u, -np.inf),
                      (best_value - M * current.total + slack) / (K - 1))
            if cap < floor or M * current.total + (K - 1) * floor >= best_value:
                break
            nxt = _solve_capped(tables, micro_batch_size, cap)
            evaluations += 1
            if nxt is None:
                break
            if objective(nxt) < best_value:
                best, best_value = nxt, objective(nxt)
            current = nxt
    plan = _plan_from_parts(best.parts, unit, order, micro_batch_size)
    return SlicingSolution(plan=plan, objective=best_value, sum_time=best.total,
                           max_time=best.max_u, dp_evaluations=evaluations,
                           solve_seconds=time.perf_counter() - started)


def best_uniform_slicing(cost_model: CostModel, seq_length: int, micro_batch_size: int,
                         num_stages: int, granularity: int = 8, num_microbatches: int = 1,
                         order: str = "1f1b", multiple_of: int = 1,
                         include_transfer: bool = True) -> tuple[TeraPipePlan, float]:
    """The best plan of n near-equal token slices (no batch slicing), and its objective."""
    unit = slicing_unit(seq_length, granularity, multiple_of)
    best_plan, best_value = None, np.inf
    for n in range(1, seq_length // unit + 1):
        plan = TeraPipePlan.uniform(seq_length, n, order=order, multiple_of=unit)
        value = plan_objective(plan, cost_model, micro_batch_size, num_stages, num_microbatches,
                               include_transfer)
        if value < best_value:
            best_plan, best_value = plan, value
    assert best_plan is not None
    return best_plan, float(best_value)
