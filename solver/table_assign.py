"""Placing the chosen shards on ranks: longest processing time first, onto the least loaded.

Table-wise and column-wise shards go to single ranks and table-row-wise / grid groups to whole
nodes (TorchRec's placement is not SPMD: each table carries its own ranks). Items are placed in
decreasing time (Graham's LPT: within 4/3 of the best makespan, and exact for alike items that
divide evenly), ties broken by rank index so the same inputs give the same plan; a rank is
skipped when the shard would not fit in its memory.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from shardplan.costmodel.embedding import OptionCost, TableSpec, World

from .table_plan import TableChoice


class AssignmentError(Exception):
    """No rank (or node) with room for a shard; ``needed`` is its HBM bytes."""

    def __init__(self, needed: float) -> None:
        super().__init__(needed)
        self.needed = needed


@dataclass(slots=True)
class Loads:
    """Per-rank seconds, HBM and host bytes as shards are placed."""

    time: list[float]
    hbm: list[float]
    host: list[float]

    def add(self, rank: int, cost: OptionCost) -> None:
        self.time[rank] += cost.time
        self.hbm[rank] += cost.hbm
        self.host[rank] += cost.host

    def fits(self, rank: int, cost: OptionCost, hbm: float, host: float) -> bool:
        return self.hbm[rank] + cost.hbm <= hbm and self.host[rank] + cost.host <= host


def assign(
    picks: list[tuple[TableSpec, OptionCost]],
    world: World,
    hbm: float,
    host: float,
    by: str = "time",
    balance: str = "time",
) -> tuple[list[TableChoice], Loads]:
    """Ranks for every ``(table, option)``; raises ``AssignmentError`` when a shard has no room.

    Items go in decreasing ``by`` (``time``: Graham's LPT; ``hbm``: largest shards first, for
    tight memory) onto the rank with the least ``balance`` (seconds, or HBM as a last resort).
    """
    W = world.size
    loads = Loads([0.0] * W, [0.0] * W, [0.0] * W)
    placed: dict[int, tuple[tuple[int, ...], ...]] = {}
    everyone = tuple(range(W))
    for i, (_, cost) in enumerate(picks):
        if cost.placement == "all":
            placed[i] = (everyone,)
            for r in everyone:
                loads.add(r, cost)
    order = sorted(range(len(picks)), key=lambda i: (-getattr(picks[i][1], by), i))
    nodes = [i for i in order if picks[i][1].placement == "node"]
    ranks = [i for i in order if picks[i][1].placement == "rank"]
    for i in nodes:
        placed[i] = _place_on_nodes(picks[i][1], world, loads, hbm, host, balance)
    metric = getattr(loads, balance)
    heap = [(metric[r], r) for r in everyone]
    heapq.heapify(heap)
    for i in ranks:
        placed[i] = _place_on_ranks(picks[i][1], heap, loads, (hbm, host), metric)
    choices = [TableChoice(t, c, placed[i]) for i, (t, c) in enumerate(picks)]
    return choices, loads


def _place_on_nodes(
    cost: OptionCost, world: World, loads: Loads, hbm: float, host: float, by: str
) -> tuple[tuple[int, ...], ...]:
    """``cost.groups`` distinct least-loaded nodes with room; every rank of each gets a shard."""
    local = world.local
    members = [tuple(range(n * local, (n + 1) * local)) for n in range(world.nodes)]
    metric = getattr(loads, by)
    ranked = sorted(range(world.nodes), key=lambda n: (max(metric[r] for r in members[n]), n))
    chosen = [n for n in ranked if all(loads.fits(r, cost, hbm, host) for r in members[n])]
    if len(chosen) < cost.groups:
        raise AssignmentError(cost.hbm)
    groups = tuple(members[n] for n in sorted(chosen[: cost.groups]))
    for group in groups:
        for r in group:
            loads.add(r, cost)
    return groups


def _place_on_ranks(
    cost: OptionCost,
    heap: list[tuple[float, int]],
    loads: Loads,
    limits: tuple[float, float],
    metric: list[float],
) -> tuple[tuple[int, ...], ...]:
    """``cost.groups`` distinct least-loaded ranks with room (a heap of ``(load, rank)``)."""
    hbm, host = limits
    chosen, skipped = [], []
    while heap and len(chosen) < cost.groups:
        load, r = heapq.heappop(heap)
        (chosen if loads.fits(r, cost, hbm, host) else skipped).append((load, r))
    for entry in skipped:
        heapq.heappush(heap, entry)
    if len(chosen) < cost.groups:
        for entry in chosen:
            heapq.heappush(heap, entry)
        raise AssignmentError(cost.hbm)
    for _, r in chosen:
        loads.add(r, cost)
        heapq.heappush(heap, (metric[r], r))
    return tuple((r,) for _, r in sorted(chosen, key=lambda e: e[1]))
