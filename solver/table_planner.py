"""``plan_tables``: classes -> CP-SAT over counts -> LPT placement -> a ``TablePlan``."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from shardplan.costmodel.dense_part import DENSE_MODES, DenseSpec, price_dense
from shardplan.costmodel.embedding import TableSpec, TableSpecError, World
from shardplan.ir.errors import InfeasiblePlanError

from .table_assign import AssignmentError, Loads, assign
from .table_exact import EXACT_LIMIT, exact_size, solve_exact
from .table_plan import TableChoice, TablePlan, gib
from .tables import (
    HEADROOM,
    Budget,
    TableClass,
    _NoSolution,
    solve_classes,
    spread,
    table_classes,
    type_latency,
)

HOST_MEMORY_PER_NODE = 2 * 2**40
"""DGX H100 system memory, 2 TB (NVIDIA DGX H100 datasheet; an assumption for other nodes)."""
ATTEMPTS = 4


def plan_tables(
    tables: Sequence[TableSpec],
    world: World,
    dense: DenseSpec | None = None,
    *,
    hbm_limit: float | None = None,
    host_limit: float | None = None,
    sharding_types: Iterable[str] | None = None,
    kernels: Iterable[str] | None = None,
    pins: Mapping[str, str] | None = None,
    dense_modes: Sequence[str] = DENSE_MODES,
    time_limit: float = 5.0,
) -> TablePlan:
    """Plan every table's sharding and the dense part's mode (module docstrings of ``tables``).

    Args:
        tables: the embedding tables (alike ones are solved as one class).
        world: ranks, cluster, batch per rank, sparse optimizer (``costmodel.embedding``).
        dense: the dense part, priced as DDP or FSDP in the same decision (``None``: none).
        hbm_limit: HBM bytes per rank (default: the cluster's capacity).
        host_limit: host bytes per rank for UVM (default: 2 TB per node shared by its ranks).
        sharding_types, kernels: restrict the choices (e.g. ``["table_wise"]``).
        pins: table name -> the sharding type it must take.
        dense_modes: the dense modes to choose from (``("ddp",)`` pins DDP).
        time_limit: CP-SAT seconds.
    Returns:
        The ``TablePlan``; raises ``InfeasiblePlanError`` naming the memory needed if none fits.
    """
    start = time.perf_counter()
    names = [t.name for t in tables]
    if len(set(names)) != len(names) or not tables:
        raise TableSpecError("plan_tables needs at least one table and distinct table names")
    limit = (hbm_limit or world.cluster.hbm_capacity) * (1 - HEADROOM)
    host = host_limit if host_limit is not None else HOST_MEMORY_PER_NODE / world.local
    classes = table_classes(tables, world, pins, sharding_types=sharding_types, kernels=kernels)
    empty = [c for c in classes if not c.costs]
    if empty:
        raise TableSpecError(
            f"table {empty[0].tables[0].name!r}: no option left under sharding_types="
            f"{sharding_types} kernels={kernels} pins={dict(pins or {})}; allow more (a "
            "pinned table_row_wise or grid needs two nodes at least)"
        )
    dense_costs = [price_dense(dense, mode, world) for mode in dense_modes]
    room = limit - min(d.hbm for d in dense_costs)
    fitting = [fits(cls, room, host) for cls in classes]  # a shard no rank can hold: dropped
    if any(not cls.costs for cls in fitting):
        raise _infeasible(classes, world, dense_costs, limit, host)
    classes = fitting
    budget = Budget(limit, host)
    if exact_size(classes, world) <= EXACT_LIMIT:  # few placements: the exact optimum
        try:
            found = solve_exact(classes, world, dense_costs, budget, time_limit)
        except _NoSolution:
            raise _infeasible(classes, world, dense_costs, limit, host) from None
        choices, loads, dense_cost, bound, status = found
        return _plan(choices, loads, world, dense_cost, bound, status, start, limit)
    best = _solve_by_counts(classes, world, dense_costs, budget, time_limit, start, limit)
    if best is not None:
        return best
    raise _infeasible(classes, world, dense_costs, limit, host)


def _solve_by_counts(classes, world: World, dense_costs, budget: Budget, time_limit: float,
                     start: float, limit: float) -> TablePlan | None:  # type: ignore[no-untyped-def]  # fmt: skip
    """CP-SAT over per-class counts, then LPT placement, up to ``ATTEMPTS`` times (each retry
    leaves a largest shard's room when placement failed or full ranks unbalanced the plan);
    the fastest plan, or None when the counts found none."""
    best: TablePlan | None = None
    first_bound = None
    host = budget.host
    for _ in range(ATTEMPTS):
        try:
            counts, dense_cost, bound, status = solve_classes(
                classes, world, dense_costs, budget, time_limit
            )
        except _NoSolution:
            break
        first_bound = bound if first_bound is None else first_bound
        picks = expand(classes, counts)
        largest = max(c.hbm for _, c in picks)
        try:
            placed = place(picks, world, limit - dense_cost.hbm, host)
        except AssignmentError:  # averages fit, one rank does not: leave a shard's room
            budget = Budget(budget.hbm - largest, budget.host)
            continue
        plan = _plan(*placed, world, dense_cost, first_bound, status, start, limit)
        if best is None or plan.iteration_time < best.iteration_time:
            best = plan
        slack = max(c.time for _, c in picks)  # LPT's makespan is within one shard of the mean
        if plan.iteration_time <= bound + slack:
            break
        budget = Budget(budget.hbm - largest, budget.host)  # full ranks unbalanced it: retry
    return best


def fits(cls: TableClass, hbm: float, host: float) -> TableClass:
    """``cls`` with only the options whose one shard fits a rank next to the dense part."""
    costs = tuple(c for c in cls.costs if c.hbm <= hbm and c.host <= host)
    return TableClass(cls.tables, costs)


def place(picks: list, world: World, hbm: float, host: float) -> tuple:
    """LPT by time; where memory is too tight for it, big shards first; then balance memory."""
    orders = (("time", "time"), ("hbm", "time"), ("hbm", "hbm"))
    for by, balance in orders[:-1]:
        try:
            return assign(picks, world, hbm, host, by=by, balance=balance)
        except AssignmentError:
            pass
    return assign(picks, world, hbm, host, by="hbm", balance="hbm")


def expand(classes: list[TableClass], counts: dict) -> list:
    """``(table, option cost)`` per table: a class's tables take its options in option order."""
    picks = []
    for ci, cls in enumerate(classes):
        members = iter(cls.tables)
        for cost, n in counts.get(ci, []):
            picks += [(next(members), cost) for _ in range(n)]
    return picks


def _plan(choices, loads: Loads, world, dense_cost, bound, status, start, limit) -> TablePlan:  # type: ignore[no-untyped-def]
    latency = type_latency({c.option.sharding_type for c in choices}, world)
    hbm = tuple(h + dense_cost.hbm for h in loads.hbm)
    return TablePlan(
        tuple(sorted(choices, key=lambda c: c.table.name)), world, dense_cost.mode,
        dense_cost.time, dense_cost.hbm, tuple(loads.time), hbm, tuple(loads.host), latency,
        bound, time.perf_counter() - start, status, limit,
    )  # fmt: skip


def evaluate_choices(
    choices: Sequence[TableChoice], world: World, dense: DenseSpec | None, dense_mode: str
) -> TablePlan:
    """A given placement (e.g. TorchRec's plan) priced by this cost model, no solving."""
    W = world.size
    loads = Loads([0.0] * W, [0.0] * W, [0.0] * W)
    for choice in choices:
        for group in choice.ranks:
            for r in group:
                loads.add(r, choice.cost)
    dense_cost = price_dense(dense, dense_mode, world)
    limit = world.cluster.hbm_capacity * (1 - HEADROOM)
    return _plan(list(choices), loads, world, dense_cost, 0.0, "given", time.perf_counter(), limit)


def _infeasible(classes, world: World, dense_costs, limit: float, host: float):  # type: ignore[no-untyped-def]
    """The error naming the least HBM per rank any plan needs, and what to change."""
    tables = 0.0
    for cls in classes:
        per_rank = min(c.hbm * spread(c, world) / world.size for c in cls.costs)
        tables += len(cls.tables) * per_rank
    dense = min(d.hbm for d in dense_costs)
    need = tables + dense
    host_need = sum(
        len(cls.tables) * min(c.host * spread(c, world) / world.size for c in cls.costs)
        for cls in classes
    )
    return InfeasiblePlanError(
        f"the embedding tables do not fit on {world.size} ranks: the plan needs at least "
        f"{gib(need)} of HBM per rank (tables {gib(tables)}, dense {gib(dense)}) against a "
        f"limit of {gib(limit)}, and at least {gib(host_need)} of host memory per rank "
        f"(limit {gib(host)})\n  hint: add ranks, allow the UVM kernels "
        "(kernels=['fused_uvm_caching', 'fused_uvm']), shard the dense part (dense_modes "
        "with 'fsdp'), or raise hbm_limit / host_limit"
    )
