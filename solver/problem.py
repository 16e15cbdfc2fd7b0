"""The layout-selection problem, independent of graphs: pick one strategy per node.

    minimise  sum_n node_cost[n][s_n] + sum_(u,v) edge.cost[group_u(s_u)][group_v(s_v)]
    s.t.      sum_n memory[n][s_n] <= memory_limit

Edge costs are stored per *layout group*: many strategies of a producer yield the same result
layout, many of a consumer need the same operand layout, so a k_u x k_v matrix collapses to
(distinct layouts) x (distinct layouts). Nodes are eliminated here, generically: a node whose
strategy is a function of another's (a follower, or a copy of a repeated layer) disappears and
its costs fold into its leader; parallel edges are then coalesced into one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False, slots=True)
class Edge:
    u: int
    v: int
    u_group: np.ndarray
    """Per strategy of u, the row of ``cost`` it selects."""
    v_group: np.ndarray
    """Per strategy of v, the column of ``cost`` it selects."""
    cost: np.ndarray

    def value(self, su: int, sv: int) -> float:
        return float(self.cost[self.u_group[su], self.v_group[sv]])

    def full(self) -> np.ndarray:
        """The k_u x k_v matrix over strategies."""
        return self.cost[self.u_group][:, self.v_group]


@dataclass(eq=False, slots=True)
class Problem:
    names: list[str]
    node_costs: list[np.ndarray]
    edge_table: dict[int, Edge] = field(default_factory=dict)
    memory: list[np.ndarray] | None = None
    memory_limit: float | None = None
    eliminated: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    """(follower, leader, leader strategy -> follower strategy), in elimination order."""
    chains: list = field(default_factory=list)
    """``solver.eliminate.Eliminated`` records (exact eliminations, after every follower's),
    in elimination order."""
    alive: list[bool] = field(default_factory=list)
    adjacency: dict[int, set[int]] = field(default_factory=dict)
    """Node -> ids of the edges touching it."""
    _next_edge: int = 0

    def __post_init__(self) -> None:
        if not self.alive:
            self.alive = [True] * len(self.node_costs)

    @property
    def edges(self) -> list[Edge]:
        return list(self.edge_table.values())

    @property
    def sizes(self) -> list[int]:
        return [len(c) for c in self.node_costs]

    def live_nodes(self) -> list[int]:
        return [n for n, a in enumerate(self.alive) if a]

    def copy(self) -> Problem:
        """An independent copy (``copy.deepcopy`` is ~10x slower on 10k-node problems). An
        eliminated node's arrays are shared, not copied: nothing writes them again (a node
        never comes back, and costs are replaced, never written in place), and a shrunk
        Llama-3-70B keeps 195 of 32,136 nodes (the seed copies it per strategy)."""
        edges = {
            k: Edge(e.u, e.v, e.u_group.copy(), e.v_group.copy(), e.cost.copy())
            for k, e in self.edge_table.items()
        }
        alive = self.alive
        costs = [c.copy() if a else c for c, a in zip(self.node_costs, alive, strict=True)]
        memory = None
        if self.memory is not None:
            memory = [m.copy() if a else m for m, a in zip(self.memory, alive, strict=True)]
        return Problem(
            list(self.names), costs, edges, memory,
            self.memory_limit, list(self.eliminated), list(self.chains), list(self.alive),
            {n: set(ids) for n, ids in self.adjacency.items()}, self._next_edge,
        )  # fmt: skip

    def add_grouped_edge(
        self, u: int, v: int, u_group, v_group, cost: np.ndarray, nonzero: bool = False
    ) -> None:
        """Add an edge unless every cost is zero (``nonzero``: the caller checked that)."""
        if not nonzero and not np.any(cost != 0):
            return
        if u == v:  # a self-edge is a node cost
            idx = np.arange(len(u_group))
            self.node_costs[u] = self.node_costs[u] + cost[u_group[idx], v_group[idx]]
            return
        self._insert(Edge(u, v, np.asarray(u_group), np.asarray(v_group), cost))

    def _insert(self, edge: Edge) -> None:
        key = self._next_edge
        self._next_edge += 1
        self.edge_table[key] = edge
        self.adjacency.setdefault(edge.u, set()).add(key)
        self.adjacency.setdefault(edge.v, set()).add(key)

    def _remove(self, key: int) -> Edge:
        edge = self.edge_table.pop(key)
        self.adjacency[edge.u].discard(key)
        self.adjacency[edge.v].discard(key)
        return edge

    def evaluate(self, choice: list[int]) -> float:
        """Objective of a full assignment (eliminated followers need not be consistent here)."""
        total = sum(float(self.node_costs[n][choice[n]]) for n in self.live_nodes())
        return total + sum(e.value(choice[e.u], choice[e.v]) for e in self.edge_table.values())

    def cost_peak(self) -> float:
        """Largest finite |cost| of any live node or edge (solvers scale costs against it)."""
        finite = [c[np.isfinite(c)] for c in (self.node_costs[n] for n in self.live_nodes())]
        finite += [e.cost[np.isfinite(e.cost)] for e in self.edge_table.values()]
        return max([float(np.max(np.abs(c))) for c in finite if c.size] + [0.0])

    def memory_of(self, choice: list[int]) -> float:
        if self.memory is None:
            return 0.0
        return sum(float(self.memory[n][choice[n]]) for n in self.live_nodes())

    # -- elimination --------------------------------------------------------------------------
    def eliminate(
        self, follower: int, leader: int, mapping: np.ndarray, identity: bool | None = None
    ) -> None:
        """Make ``follower`` take strategy ``mapping[s]`` whenever ``leader`` takes ``s``
        (``identity``: the caller knows ``mapping`` is ``arange``, a repeated layer's copy)."""
        f, ld = follower, leader
        if identity is None:
            identity = len(mapping) == len(self.node_costs[f]) and bool(
                np.array_equal(mapping, np.arange(len(mapping)))
            )  # a repeated layer's copy: groups stay as they are, nothing to compact

        def pick(per_strategy: np.ndarray) -> np.ndarray:
            return per_strategy if identity else per_strategy[mapping]

        self.node_costs[ld] = self.node_costs[ld] + pick(self.node_costs[f])
        if self.memory is not None:
            self.memory[ld] = self.memory[ld] + pick(self.memory[f])
        for key in sorted(self.adjacency.get(f, ())):
            e = self._remove(key)
            u, ug = (ld, pick(e.u_group)) if e.u == f else (e.u, e.u_group)
            v, vg = (ld, pick(e.v_group)) if e.v == f else (e.v, e.v_group)
            if u == v:
                idx = np.arange(len(mapping))
                self.node_costs[ld] = self.node_costs[ld] + e.cost[ug[idx], vg[idx]]
            else:
                edge = Edge(u, v, ug, vg, e.cost)
                self._insert(edge if identity else _compact(edge))
        self.alive[f] = False
        self.eliminated.append((f, ld, mapping))

    def expand(self, choice: list[int]) -> list[int]:
        """Fill in eliminated nodes from their leaders (reverse elimination order)."""
        full = list(choice)
        for record in reversed(self.chains):
            full[record.node] = record.pick(full)
        for f, ld, mapping in reversed(self.eliminated):
            full[f] = int(mapping[full[ld]])
        return full

    def follow_mapping(self, follower: int, leader: int) -> np.ndarray:
        """For each leader strategy, the follower strategy cheapest given the edges between them."""
        cost = np.tile(self.node_costs[follower], (len(self.node_costs[leader]), 1))
        for key in self.adjacency.get(follower, ()):
            e = self.edge_table[key]
            if e.u == leader and e.v == follower:
                cost = cost + e.full()
            elif e.u == follower and e.v == leader:
                cost = cost + e.full().T
        return np.argmin(cost, axis=1)  # ties go to the lowest index: deterministic

    def coalesce(self) -> None:
        """Merge parallel edges (same endpoints) into one, summing their costs."""
        by_pair: dict[tuple[int, int], list[int]] = {}
        for key, e in self.edge_table.items():
            by_pair.setdefault((min(e.u, e.v), max(e.u, e.v)), []).append(key)
        for (u, v), keys in sorted(by_pair.items()):
            if len(keys) >= 2:
                _merge(self, u, v, keys)


def merge_parallel(problem: Problem, a: int, b: int) -> None:
    """Merge the edges between ``a`` and ``b`` (if several) into one."""
    keys = sorted(problem.adjacency.get(a, set()) & problem.adjacency.get(b, set()))
    if len(keys) >= 2:
        _merge(problem, min(a, b), max(a, b), keys)


def _merge(problem: Problem, u: int, v: int, keys: list[int]) -> None:
    edges = [problem._remove(k) for k in keys]
    if (same := _same_groups(edges, u, v)) is not None:  # copies of one layer's edge
        problem.add_grouped_edge(u, v, *same)
        return
    u_keys = np.stack([e.u_group if e.u == u else e.v_group for e in edges], axis=1)
    v_keys = np.stack([e.v_group if e.v == v else e.u_group for e in edges], axis=1)
    u_rows, u_group = np.unique(u_keys, axis=0, return_inverse=True)
    v_rows, v_group = np.unique(v_keys, axis=0, return_inverse=True)
    cost = np.zeros((len(u_rows), len(v_rows)))
    for i, e in enumerate(edges):
        block = e.cost if e.u == u else e.cost.T
        cost += block[np.ix_(u_rows[:, i], v_rows[:, i])]
    problem.add_grouped_edge(u, v, u_group.reshape(-1), v_group.reshape(-1), cost)


def _same_groups(edges: list[Edge], u: int, v: int) -> tuple | None:
    """(u groups, v groups, summed cost) when every edge groups u and v alike, else None."""
    oriented = [(e.u_group, e.v_group, e.cost) if e.u == u else (e.v_group, e.u_group, e.cost.T)
                for e in edges]  # fmt: skip
    ug, vg, cost = oriented[0]
    for g_u, g_v, c in oriented[1:]:
        if c.shape != cost.shape or not (_same(g_u, ug) and _same(g_v, vg)):
            return None
    return ug, vg, sum(c for _, _, c in oriented)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal group arrays (copies of one edge usually share the very array); the bytes compare
    is ~10x cheaper than ``np.array_equal`` on these few-element arrays."""
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes())


def group_layouts(layouts: list) -> tuple[list, np.ndarray]:
    """Distinct layouts in first-seen order, and per strategy the index of its layout."""
    keys: dict = {}
    group = np.array([keys.setdefault(layout, len(keys)) for layout in layouts], dtype=np.int64)
    return list(keys), group


def _compact(e: Edge) -> Edge:
    """Drop rows/columns no strategy selects any more and renumber the groups (an edge whose
    groups are all still selected is returned as it is: ``np.unique`` would renumber nothing)."""
    rows_n, cols_n = e.cost.shape
    if _covers(e.u_group, rows_n) and _covers(e.v_group, cols_n):
        return e
    rows, u_group = _renumber(e.u_group, rows_n)
    cols, v_group = _renumber(e.v_group, cols_n)
    return Edge(e.u, e.v, u_group, v_group, e.cost[np.ix_(rows, cols)])


def _renumber(group: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(group, return_inverse=True)`` for groups in ``0 .. count-1``: the selected
    groups in order and each strategy's index among them (a few small ops, ~10x cheaper)."""
    used = np.bincount(group, minlength=count) > 0
    return np.flatnonzero(used), (np.cumsum(used) - 1)[group]


def _covers(group: np.ndarray, count: int) -> bool:
    """Whether ``group`` selects each of ``0 .. count-1`` (then compacting renumbers nothing;
    ``np.unique`` per edge was a third of the pruning's time on the JAX GPT)."""
    return len(group) >= count and bool(np.bincount(group, minlength=count).all())
