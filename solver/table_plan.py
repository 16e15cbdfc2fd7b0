"""The per-table plan: each table's sharding type, kernel and ranks, with its modelled prices."""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.costmodel.embedding import Option, OptionCost, TableSpec, World


@dataclass(frozen=True, slots=True)
class TableChoice:
    """One table's placement.

    Invariants: ``ranks`` holds one tuple per shard group (``column_shards`` groups for
    column-wise and grid, one otherwise); each group lists the ranks holding that group's
    row shards (one rank for table/column-wise, a node's ranks for table-row-wise and grid,
    every rank for row-wise and data-parallel).
    """

    table: TableSpec
    cost: OptionCost
    ranks: tuple[tuple[int, ...], ...]

    @property
    def option(self) -> Option:
        return self.cost.option

    def rank_set(self) -> tuple[int, ...]:
        return tuple(sorted({r for group in self.ranks for r in group}))


@dataclass(frozen=True, slots=True)
class TablePlan:
    """A plan for a model's embedding tables and its dense part.

    Invariants: ``rank_time``/``rank_hbm``/``rank_host`` have one entry per rank;
    ``iteration_time = max(rank_time) + dense_time`` (TorchRec's critical path over ranks,
    plus the dense part); ``lower_bound <= iteration_time``.
    """

    choices: tuple[TableChoice, ...]
    world: World
    dense_mode: str
    dense_time: float
    dense_hbm: float
    rank_time: tuple[float, ...]
    rank_hbm: tuple[float, ...]
    rank_host: tuple[float, ...]
    latency: float
    lower_bound: float
    solve_seconds: float
    status: str
    hbm_limit: float

    @property
    def sparse_time(self) -> float:
        return max(self.rank_time) + self.latency

    @property
    def iteration_time(self) -> float:
        return self.sparse_time + self.dense_time

    @property
    def peak_hbm(self) -> float:
        return max(self.rank_hbm)

    def by_name(self) -> dict[str, TableChoice]:
        return {c.table.name: c for c in self.choices}

    def summary(self, limit: int = 20) -> str:
        """A readable table: one line per table (alike rows grouped), then the totals."""
        lines = [
            f"tables         {len(self.choices)} on {self.world.size} ranks "
            f"({self.world.nodes} nodes of {self.world.local}), {self.world.cluster.name}",
            f"iteration      {self.iteration_time * 1e3:.2f} ms modelled (sparse "
            f"{self.sparse_time * 1e3:.2f} ms = max over ranks; dense {self.dense_mode} "
            f"{self.dense_time * 1e3:.2f} ms); bound {self.lower_bound * 1e3:.2f} ms",
            f"memory/rank    HBM {gib(self.peak_hbm)} peak of {gib(self.hbm_limit)} "
            f"(dense {gib(self.dense_hbm)}), host {gib(max(self.rank_host))}",
            f"solver         {self.status}, {self.solve_seconds:.2f} s",
            "",
            f"  {'table':<24} {'sharding':<34} {'ranks':<16} {'HBM/shard':>10} {'ms/shard':>9}",
        ]
        groups: dict[tuple, list[TableChoice]] = {}
        for choice in self.choices:
            key = (str(choice.option), choice.cost.hbm, choice.cost.time)
            groups.setdefault(key, []).append(choice)
        for (option, hbm, seconds), members in list(groups.items())[:limit]:
            name = members[0].table.name
            if len(members) > 1:
                name += f" (+{len(members) - 1} alike)"
            lines.append(
                f"  {name:<24} {option:<34} {_ranks_text(members):<16} {gib(hbm):>10} "
                f"{seconds * 1e3:>9.4f}"
            )
            del groups[(option, hbm, seconds)]
        if groups:
            rest = sum(len(m) for m in groups.values())
            lines.append(f"  ... {rest} more tables in {len(groups)} groups (plan.choices)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _ranks_text(choices: list[TableChoice]) -> str:
    ranks = tuple(sorted({r for c in choices for r in c.rank_set()}))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"{len(ranks)} ranks"


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
