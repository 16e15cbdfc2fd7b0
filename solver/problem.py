"""The layout-selection problem, independent of graphs: pick one strategy per node.

    minimise  sum_n node_cost[n][s_n] + sum_(u,v) edge.cost[group_u(s_u)][group_v(s_v)]
    s.t.      sum_n memory[n][s_n] <= memory_limit

Edge costs are stored per *layout group*: many strategies of a producer yield the same result
layout, many of a consumer need the same operand layout, so a k_u x k_v matrix collapses to
(distinct layouts) x (distinct layouts). Followers are eliminated here, generically: a node
whose strategy is a function of another's disappears and its costs fold into its leader.
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


@dataclass(eq=False, slots=True)
class Problem:
    names: list[str]
    node_costs: list[np.ndarray]
    edges: list[Edge] = field(default_factory=list)
    memory: list[np.ndarray] | None = None
    memory_limit: float | None = None
    eliminated: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    """(follower, leader, leader strategy -> follower strategy), in elimination order."""
    alive: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.alive:
            self.alive = [True] * len(self.node_costs)

    @property
    def sizes(self) -> list[int]:
        return [len(c) for c in self.node_costs]

    def live_nodes(self) -> list[int]:
        return [n for n, a in enumerate(self.alive) if a]

    def add_edge(self, u: int, v: int, u_layouts: list, v_layouts: list, cost_fn) -> None:
        """Add an edge whose cost depends on (u's layout, v's layout); layouts are hashable."""
        u_keys, u_group = _group(u_layouts)
        v_keys, v_group = _group(v_layouts)
        cost = np.array([[cost_fn(a, b) for b in v_keys] for a in u_keys], dtype=float)
        if np.any(cost != 0):
            self.edges.append(Edge(u, v, u_group, v_group, cost))

    def evaluate(self, choice: list[int]) -> float:
        """Objective of a full assignment (eliminated followers need not be consistent here)."""
        total = sum(float(self.node_costs[n][choice[n]]) for n in self.live_nodes())
        return total + sum(e.value(choice[e.u], choice[e.v]) for e in self.edges)

    def memory_of(self, choice: list[int]) -> float:
        if self.memory is None:
            return 0.0
        return sum(float(self.memory[n][choice[n]]) for n in self.live_nodes())

    # -- follower elimination ---------------------------------------------------------------
    def eliminate(self, follower: int, leader: int, mapping: np.ndarray) -> None:
        """Make ``follower`` take strategy ``mapping[s]`` whenever ``leader`` takes ``s``."""
        f, ld = follower, leader
        self.node_costs[ld] = self.node_costs[ld] + self.node_costs[f][mapping]
        if self.memory is not None:
            self.memory[ld] = self.memory[ld] + self.memory[f][mapping]
        kept: list[Edge] = []
        for e in self.edges:
            if f not in (e.u, e.v):
                kept.append(e)
                continue
            if e.u == f:
                e.u, e.u_group = ld, e.u_group[mapping]
            if e.v == f:
                e.v, e.v_group = ld, e.v_group[mapping]
            if e.u == e.v:  # both ends on the leader: a node cost now
                idx = np.arange(len(mapping))
                self.node_costs[ld] = self.node_costs[ld] + e.cost[e.u_group[idx], e.v_group[idx]]
            else:
                kept.append(_compact(e))
        self.edges = kept
        self.alive[f] = False
        self.eliminated.append((f, ld, mapping))

    def expand(self, choice: list[int]) -> list[int]:
        """Fill in eliminated followers from their leaders (reverse elimination order)."""
        full = list(choice)
        for f, ld, mapping in reversed(self.eliminated):
            full[f] = int(mapping[full[ld]])
        return full

    def follow_mapping(self, follower: int, leader: int) -> np.ndarray:
        """For each leader strategy, the follower strategy cheapest given the edges between them."""
        cost = np.tile(self.node_costs[follower], (len(self.node_costs[leader]), 1))
        for e in self.edges:
            if e.u == leader and e.v == follower:
                cost = cost + e.cost[e.u_group][:, e.v_group]
            elif e.u == follower and e.v == leader:
                cost = cost + e.cost[e.u_group][:, e.v_group].T
        return np.argmin(cost, axis=1)  # ties go to the lowest index: deterministic


def _group(layouts: list) -> tuple[list, np.ndarray]:
    keys: dict = {}
    group = np.array([keys.setdefault(layout, len(keys)) for layout in layouts], dtype=np.int64)
    return list(keys), group


def _compact(e: Edge) -> Edge:
    """Drop rows/columns no strategy selects any more and renumber the groups."""
    rows, u_group = np.unique(e.u_group, return_inverse=True)
    cols, v_group = np.unique(e.v_group, return_inverse=True)
    return Edge(e.u, e.v, u_group, v_group, e.cost[np.ix_(rows, cols)])
