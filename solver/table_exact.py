"""Exact table placement for small instances: one CP-SAT boolean per (table, option, ranks).

Every placement is enumerated (table-wise on each rank, column shards on each set of distinct
ranks, node groups on each set of distinct nodes), so the optimum is the true one, not a bound
plus a greedy; ``plan_tables`` uses it while the placements stay few (``EXACT_LIMIT``), and the
tests check it against brute force.
"""

from __future__ import annotations

from itertools import combinations
from math import comb

from ..costmodel.dense_part import DenseCost
from ..costmodel.embedding import OptionCost, World, fixed_latency
from .table_assign import Loads
from .table_plan import TableChoice
from .tables import COLLECTIVES, Budget, TableClass, _kib, _NoSolution, _ns

EXACT_LIMIT = 4000
"""Most booleans the exact model takes (placements summed over tables)."""


def placements(cost: OptionCost, world: World) -> list[tuple[tuple[int, ...], ...]]:
    """Every way to put ``cost``'s shard groups on ranks."""
    if cost.placement == "all":
        return [(tuple(range(world.size)),)]
    if cost.placement == "rank":
        return [tuple((r,) for r in c) for c in combinations(range(world.size), cost.groups)]
    local = world.local
    nodes = [tuple(range(n * local, (n + 1) * local)) for n in range(world.nodes)]
    return [tuple(nodes[n] for n in c) for c in combinations(range(world.nodes), cost.groups)]


def placement_count(cost: OptionCost, world: World) -> int:
    """``len(placements(cost, world))`` without listing them (there may be 10^18)."""
    if cost.placement == "all":
        return 1
    return comb(world.size if cost.placement == "rank" else world.nodes, cost.groups)


def exact_size(classes: list[TableClass], world: World) -> int:
    per_class = [
        len(cls.tables) * sum(placement_count(c, world) for c in cls.costs) for cls in classes
    ]
    return sum(per_class)


def solve_exact(
    classes: list[TableClass],
    world: World,
    dense_costs: list[DenseCost],
    budget: Budget,
    time_limit: float = 5.0,
) -> tuple[list[TableChoice], Loads, DenseCost, float, str]:
    """The optimal placement (module docstring); raises ``_NoSolution`` when nothing fits."""
    from ortools.sat.python import cp_model  # lazily: it pulls in pandas (test_lazy_cpsat)

    model = cp_model.CpModel()
    W = world.size
    time_terms: list[list] = [[] for _ in range(W)]
    hbm_terms: list[list] = [[] for _ in range(W)]
    host_terms: list[list] = [[] for _ in range(W)]
    kinds: dict[str, cp_model.IntVar] = {}
    choices = []
    for cls in classes:
        for table in cls.tables:
            row = []
            for cost in cls.costs:
                kind = kinds.setdefault(
                    cost.option.sharding_type, model.new_bool_var(cost.option.sharding_type)
                )
                for groups in placements(cost, world):
                    x = model.new_bool_var("")
                    model.add_implication(x, kind)
                    row.append(x)
                    choices.append((x, TableChoice(table, cost, groups)))
                    for r in {r for g in groups for r in g}:
                        time_terms[r].append(_ns(cost.time) * x)
                        hbm_terms[r].append(_kib(cost.hbm) * x)
                        host_terms[r].append(_kib(cost.host) * x)
            model.add_exactly_one(row)
    pick = [model.new_bool_var(d.mode) for d in dense_costs]
    model.add_exactly_one(pick)
    dense_hbm = sum(_kib(d.hbm) * p for d, p in zip(dense_costs, pick, strict=True))
    sparse = model.new_int_var(0, 1 << 50, "sparse")
    for r in range(W):
        model.add(sparse >= sum(time_terms[r]))
        model.add(sum(hbm_terms[r]) + dense_hbm <= _kib(budget.hbm))
        model.add(sum(host_terms[r]) <= _kib(budget.host))
    latency = sum(_ns(fixed_latency(COLLECTIVES[k], world)) * v for k, v in kinds.items())
    dense_time = sum(_ns(d.time) * p for d, p in zip(dense_costs, pick, strict=True))
    model.minimize(sparse + latency + dense_time)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise _NoSolution(solver.status_name(status))
    chosen = [c for x, c in choices if solver.value(x)]
    loads = Loads([0.0] * W, [0.0] * W, [0.0] * W)
    for c in chosen:
        for r in c.rank_set():
            loads.add(r, c.cost)
    dense = next(d for d, p in zip(dense_costs, pick, strict=True) if solver.value(p))
    bound = solver.best_objective_bound / 1e9
    return chosen, loads, dense, bound, solver.status_name(status)
