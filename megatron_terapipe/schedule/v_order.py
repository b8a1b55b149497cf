"""The 1F1B order of a V: two model chunks per rank, down the ranks and back up.

In a V (`TeraPipePlan.virtual_placement` "v", as Zero Bubble's ZB-V places its chunks) rank k
holds virtual stages k (chunk 0) and 2K - 1 - k (chunk 1): a unit (one cell's rows and
tokens) goes forward down the ranks on chunk 0, turns on the last rank and comes back up on
chunk 1 to the loss on rank 0; its backward walks the same path the other way. Rank 0 starts
and finishes every unit, so how many units are in flight there bounds every rank's activations.

No closed form gives every rank's order here (the two chunks differ in size, and token slices
of one sequence must keep their order), so the order comes from a list schedule in model
time, the same for every rank: each chunk's forward takes its share of the stage's layers and
its backward twice that, messages take no time; a rank that is free runs, of the actions
whose inputs are there, a backward before a forward (it frees activations), then the oldest
unit, chunk 1 before chunk 0. Rank 0 starts a new unit only while fewer than K + C - 1 + `lead`
units are in flight (C: cells per microbatch, all of which reach the loss before its first
backward, as in 1F1B's warm-up): K keep it busy while a unit goes round, more cover the
messages' latency at the cost of activations. As for every order, all of a microbatch's forwards on the loss's
virtual stage run before its first backward there (exact loss normalisation), and `validate`
checks the result.
"""

from __future__ import annotations

from typing import Optional

from .orders import PerChunk, gpipe_chunked


def v_shape_1f1b(forwards: PerChunk, backwards: PerChunk, num_stages: int,
                 lead: Optional[int] = None) -> list[list]:
    """Every stage's forwards and backwards in the V's 1F1B order (module docstring), from one
    list schedule; `lead`: units in flight on rank 0 beyond K + C - 1 (None: 0)."""
    cells = len(forwards[0][0])  # a whole microbatch reaches the loss before its backward
    made = _VListSchedule(forwards, num_stages, num_stages + cells - 1 + (lead or 0))
    picked, units = {"F": forwards, "B": backwards}, made.units
    return [[picked[kind][chunk][units[u][0]][units[u][1]] for kind, u, chunk in stage]
            for stage in made.run()]


def v_shape_gpipe(forwards: PerChunk, backwards: PerChunk, num_stages: int,
                  lead: Optional[int] = None) -> list[list]:
    """Every stage's actions in gpipe's chunk-by-chunk order, which runs in a V as round a
    ring (`lead` plays no part)."""
    return [gpipe_chunked(forwards, backwards, k, num_stages, 1) for k in range(num_stages)]


#: The orders on a V's two chunks (TeraPipePlan.virtual_placement "v"), each laying out every
#: stage at once: the V's 1F1B is one list schedule over all of them.
V_ORDERS = {"1f1b": v_shape_1f1b, "gpipe": v_shape_gpipe}


class _VListSchedule:
    """The list schedule in model time (module docstring). An action is (kind, unit, virtual
    stage s): s < K is rank s's chunk 0, s >= K rank 2K - 1 - s's chunk 1."""

    def __init__(self, forwards: PerChunk, K: int, cap: int) -> None:
        self.K, self.S, self.cap = K, 2 * K, cap
        self.units = [(m, i) for m in range(len(forwards[0])) for i in range(len(forwards[0][m]))]
        seqs = [_key(forwards, unit) for unit in self.units]
        self.same_seq = [u > 0 and seqs[u - 1] == seqs[u] for u in range(len(seqs))]
        self.of_mb: dict[int, list[int]] = {}  # microbatch -> its units
        for u, (m, _) in enumerate(self.units):
            self.of_mb.setdefault(m, []).append(u)
        # model time: a chunk's forward its share of the layers, its backward twice that
        self.cost = {(kind, chunk): forwards[chunk][0][0].cell.share * (1.0 if kind == "F" else 2.0)
                     for kind in ("F", "B") for chunk in (0, 1)}
        self.done: dict[tuple, float] = {}  # action -> end time
        self.enabled: list[dict[tuple, float]] = [{} for _ in range(K)]  # rank: action -> ready

    def rank_of(self, s: int) -> int:
        return s if s < self.K else self.S - 1 - s

    def deps(self, kind: str, u: int, s: int) -> list[tuple]:
        """The actions that must end before (kind, u, s) starts."""
        if kind == "F":
            need = [("F", u, s - 1)] if s > 0 else []
            return need + ([("F", u - 1, s)] if self.same_seq[u] else [])
        need = [("F", u, s)]
        if s < self.S - 1:
            need.append(("B", u, s + 1))
        else:  # the loss: every forward of the microbatch there first
            need += [("F", v, s) for v in self.of_mb[self.units[u][0]]]
        if u + 1 < len(self.units) and self.same_seq[u + 1]:
            need.append(("B", u + 1, s))
        return need

    def try_enable(self, kind: str, u: int, s: int) -> None:
        if not 0 <= s < self.S or not 0 <= u < len(self.units) or (kind, u, s) in self.done:
            return
        ends = [self.done.get(d) for d in self.deps(kind, u, s)]
        if all(e is not None for e in ends):
            self.enabled[self.rank_of(s)][(kind, u, s)] = max(ends, default=0.0)

    def run(self) -> list[list[tuple]]:
        """Per rank, (kind, unit, chunk) in the order the list schedule runs them."""
        K, S = self.K, self.S
        free, in_flight = [0.0] * K, 0
        order: list[list[tuple]] = [[] for _ in range(K)]
        self.try_enable("F", 0, 0)
        while len(self.done) < 2 * S * len(self.units):
            choices = [(c[0], r, c[1]) for r in range(K)
                       if (c := _pick(self.enabled[r], free[r], in_flight < self.cap))]
            if not choices:
                raise RuntimeError("the V's list schedule found nothing to run")  # a bug
            start, r, (kind, u, s) = min(choices, key=lambda c: c[:2])
            del self.enabled[r][kind, u, s]
            free[r] = self.done[kind, u, s] = start + self.cost[kind, int(s >= K)]
            order[r].append((kind, u, int(s >= K)))
            in_flight += (kind == "F" and s == 0) - (kind == "B" and s == 0)
            for follow in (("F", u, s + 1), ("F", u + 1, s), ("B", u, s - 1), ("B", u - 1, s)):
                self.try_enable(*follow)
            if kind == "F" and s == S - 1:  # the loss's forwards: its backwards may start
                for v in self.of_mb[self.units[u][0]]:
                    self.try_enable("B", v, s)
        return order


def _key(forwards: PerChunk, unit: tuple) -> tuple:
    cell = forwards[0][unit[0]][unit[1]].cell
    return cell.microbatch, cell.batch_slice


def _pick(enabled: dict, free: float, may_start: bool) -> Optional[tuple[float, tuple]]:
    """(start, action): the rank's next action: the earliest it can start, and among those
    ready by then a backward first, then the oldest unit, chunk 1 first."""
    ready = [(t, a) for a, t in enabled.items() if may_start or a[0] != "F" or a[2] != 0]
    if not ready:
        return None
    start = max(free, min(t for t, _ in ready))
    now = [a for t, a in ready if t <= start]
    return start, min(now, key=lambda a: (a[0] != "B", a[1], -a[2]))
