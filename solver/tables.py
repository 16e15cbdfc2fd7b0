"""The embedding-table planner: per-table sharding type, kernel and ranks, jointly with dense.

Identical tables form a class. A MIP (HiGHS through OR-Tools' ``pywraplp``) chooses, per
class, how many of its tables take each option (sharding type x kernel x cache ratio x column
shards) and the dense part's mode (DDP or FSDP), minimising ``T + dense``. ``T`` bounds every
rank's sparse time from below by two honest limits: the balanced average (uniform shards on
every rank plus the rank- and node-placed shards spread evenly) and, per class, the mean time
of its placed shards (no more than the largest one some rank holds; exact for a class of one
table, and linear: booleans per option made HiGHS and CBC take 5 s on Criteo's 26 tables).
Memory: every rank's average HBM (and host) within its limit. A balanced greedy (longest
processing time first, onto the least-loaded ranks or nodes with room) then places the shards;
its makespan is the plan's, and the MIP's bound is the reported lower bound. TorchRec's planner
enumerates every table's options and proposes plans one at a time; classes make 4,096 alike
tables one decision.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ortools.linear_solver import pywraplp
from shardplan.costmodel.dense_part import DenseCost
from shardplan.costmodel.embedding import (
    Option,
    OptionCost,
    TableSpec,
    TableSpecError,
    World,
    candidate_options,
    fixed_latency,
    price,
)

TIME_SCALE = 1e9  # CP-SAT integers (the exact model): nanoseconds
MEMORY_SCALE = 1 / 1024  # and KiB
COLLECTIVES = {
    "data_parallel": {"all-reduce"},
    "table_wise": {"all-to-all"},
    "column_wise": {"all-to-all"},
    "row_wise": {"all-to-all", "reduce-scatter"},
    "table_row_wise": {"all-to-all", "reduce-scatter"},
    "grid": {"all-to-all", "reduce-scatter"},
}
HEADROOM = 0.02
"""Fraction of HBM kept free for the allocator's fragmentation (assumption)."""


@dataclass(frozen=True, slots=True)
class TableClass:
    """Alike tables (equal ``shape_key``) and their priced options, dominated ones removed."""

    tables: tuple[TableSpec, ...]
    costs: tuple[OptionCost, ...]


def table_classes(
    tables: Sequence[TableSpec],
    world: World,
    pins: Mapping[str, str] | None = None,
    **filters: Iterable[str] | None,
) -> list[TableClass]:
    """Group ``tables`` into classes (alike and pinned alike) and price their options.

    ``pins`` maps a table name to the sharding type it must take (TorchRec's vocabulary).
    """
    pins = dict(pins or {})
    unknown = sorted(set(pins) - {t.name for t in tables})
    if unknown:
        raise TableSpecError(f"pins name tables that are not planned: {unknown}")
    groups: dict[tuple, list[TableSpec]] = {}
    for table in tables:
        groups.setdefault((table.shape_key(), pins.get(table.name)), []).append(table)
    out = []
    for (_, pin), members in groups.items():
        options = _filtered(candidate_options(members[0], world), **filters)
        if pin is not None:
            options = [o for o in options if o.sharding_type == pin]
        costs = [price(members[0], o, world) for o in options]
        out.append(TableClass(tuple(members), tuple(undominated(costs))))
    return out


def _filtered(
    options: list[Option],
    sharding_types: Iterable[str] | None = None,
    kernels: Iterable[str] | None = None,
) -> list[Option]:
    types = set(sharding_types) if sharding_types is not None else None
    kinds = set(kernels) if kernels is not None else None
    return [
        o
        for o in options
        if (types is None or o.sharding_type in types) and (kinds is None or o.kernel in kinds)
    ]


def undominated(costs: list[OptionCost]) -> list[OptionCost]:
    """Drop an option when another of the same placement shape is no worse in time, HBM, host."""
    keep = []
    for c in costs:
        beaten = any(
            d is not c
            and (d.placement, d.groups, d.option.sharding_type)
            == (c.placement, c.groups, c.option.sharding_type)
            and (d.time, d.hbm, d.host) <= (c.time, c.hbm, c.host)
            and d.time <= c.time
            and d.hbm <= c.hbm
            and d.host <= c.host
            and (d.time, d.hbm, d.host) != (c.time, c.hbm, c.host)
            for d in costs
        )
        if not beaten:
            keep.append(c)
    return keep


def spread(cost: OptionCost, world: World) -> float:
    """Shards of one table that land on ranks: W for ``all``, groups x node size for ``node``."""
    if cost.placement == "all":
        return world.size
    if cost.placement == "node":
        return cost.groups * world.local
    return cost.groups


@dataclass(frozen=True, slots=True)
class Budget:
    """Per-rank memory limits the tables and the dense part share."""

    hbm: float
    host: float


class _ClassModel:
    """The MIP over class counts (module docstring), in microseconds and MiB for conditioning."""

    def __init__(self, classes: list[TableClass], world: World) -> None:
        # HiGHS: 0.9 s on 41 classes x 2,741 options where SCIP took 5.8 s and CBC 2.1 s
        # (measured on the shared 2-core machine, same model).
        solver = pywraplp.Solver.CreateSolver("HIGHS") or pywraplp.Solver.CreateSolver("SCIP")
        if solver is None:  # pragma: no cover - OR-Tools wheels ship both
            raise RuntimeError("OR-Tools was built without HiGHS or SCIP")
        solver.SuppressOutput()
        self.solver = solver
        self.classes = classes
        self.world = world
        self.sparse = solver.NumVar(0, solver.infinity(), "sparse")
        self.counts: dict[tuple[int, int], pywraplp.Variable] = {}
        self.uniform_time: list = []
        self.spread_time: list = []
        self.uniform_hbm: list = []
        self.spread_hbm: list = []
        self.host: list = []
        self.largest: dict[int, list] = {}
        self.shards: list[tuple[pywraplp.Variable, float, int]] = []
        for ci, cls in enumerate(classes):
            row = [self._option(ci, oi, cost, len(cls.tables)) for oi, cost in enumerate(cls.costs)]
            solver.Add(solver.Sum(row) == len(cls.tables))

    def _option(self, ci: int, oi: int, cost: OptionCost, n_tables: int) -> pywraplp.Variable:
        solver = self.solver
        n = solver.IntVar(0, n_tables, f"n{ci}_{oi}")
        self.counts[ci, oi] = n
        t, hbm, host = _us(cost.time), _mib(cost.hbm), _mib(cost.host)
        if cost.placement == "all":
            self.uniform_time.append(t * n)
            self.uniform_hbm.append(hbm * n)
            self.host.append(host * n)
        else:
            s = spread(cost, self.world) / self.world.size
            self.spread_time.append(s * t * n)
            self.spread_hbm.append(s * hbm * n)
            self.host.append(s * host * n)
            self.largest.setdefault(ci, []).append(t / n_tables * n)
            self.shards.append((n, cost.hbm, n_tables))
        return n

    def constrain(self, budget: Budget, dense_costs: list[DenseCost]) -> list[pywraplp.Variable]:
        """Time bounds, memory limits, the dense choice; returns the dense choice variables."""
        solver = self.solver
        uniform = solver.NumVar(0, solver.infinity(), "uniform")  # one row, not one per option
        solver.Add(uniform == solver.Sum(self.uniform_time))
        solver.Add(self.sparse >= uniform + solver.Sum(self.spread_time))
        for terms in self.largest.values():  # a class's mean shard: <= its largest used one
            solver.Add(self.sparse >= uniform + solver.Sum(terms))
        pick = [solver.BoolVar(f"dense_{d.mode}") for d in dense_costs]
        solver.Add(solver.Sum(pick) == 1)
        for n, hbm, n_tables in self.shards:  # a shard must fit one rank beside the dense part
            for d, p in zip(dense_costs, pick, strict=True):
                if hbm + d.hbm > budget.hbm:
                    solver.Add(n + n_tables * p <= n_tables)
        dense_hbm = solver.Sum([_mib(d.hbm) * p for d, p in zip(dense_costs, pick, strict=True)])
        tables_hbm = solver.Sum(self.uniform_hbm) + solver.Sum(self.spread_hbm)
        solver.Add(tables_hbm + dense_hbm <= _mib(budget.hbm))
        solver.Add(solver.Sum(self.host) <= _mib(budget.host))
        dense_time = solver.Sum([_us(d.time) * p for d, p in zip(dense_costs, pick, strict=True)])
        # The collectives' alphas (a few us per sharding type used) are left out here and added
        # to the plan after placement: per-type booleans tripled HiGHS's time on Criteo.
        solver.Minimize(self.sparse + dense_time)
        return pick


def solve_classes(
    classes: list[TableClass],
    world: World,
    dense_costs: list[DenseCost],
    budget: Budget,
    time_limit: float = 5.0,
) -> tuple[dict[int, list[tuple[OptionCost, int]]], DenseCost, float, str]:
    """Counts per class and option, the dense mode, the objective (a lower bound) and status."""
    built = _ClassModel(classes, world)
    pick = built.constrain(budget, dense_costs)
    solver = built.solver
    solver.SetTimeLimit(int(time_limit * 1000))
    solver.SetNumThreads(1)  # deterministic: the same inputs give the same plan
    with _native_stdout_silenced():  # HiGHS prints its banner from C++ on every MIP solve
        status = solver.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise _NoSolution(str(status))
    counts: dict[int, list[tuple[OptionCost, int]]] = {}
    for (ci, oi), var in built.counts.items():
        value = round(var.solution_value())
        if value:
            counts.setdefault(ci, []).append((classes[ci].costs[oi], value))
    dense = next(d for d, p in zip(dense_costs, pick, strict=True) if p.solution_value() > 0.5)
    # Every plan pays at least one sharding type's alphas (left out of the MIP).
    least_alpha = min(type_latency({kind}, world) for kind in COLLECTIVES)
    bound = solver.Objective().BestBound() / 1e6 + least_alpha
    name = "OPTIMAL" if status == pywraplp.Solver.OPTIMAL else "FEASIBLE"
    return counts, dense, bound, name


@contextmanager
def _native_stdout_silenced() -> Iterator[None]:
    """File descriptor 1 to /dev/null for a native call (SuppressOutput misses the banner)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real stdout (embedded interpreters): nothing to silence
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def type_latency(types: Iterable[str], world: World) -> float:
    """Alphas of the collectives of each sharding type used (TorchRec runs one set per type)."""
    return sum(fixed_latency(COLLECTIVES[kind], world) for kind in set(types))


class _NoSolution(Exception):
    """The solver found no assignment within the limits (the caller explains which)."""


def _ns(seconds: float) -> int:
    return round(seconds * TIME_SCALE)


def _kib(nbytes: float) -> int:
    return int(-(-nbytes * MEMORY_SCALE // 1))  # rounded up: never under-count memory


def _us(seconds: float) -> float:
    return seconds * 1e6


def _mib(nbytes: float) -> float:
    return nbytes / 2**20
