"""A result computed once per graph, reused while the graph keeps its op count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from shardplan.ir import Graph

T = TypeVar("T")


class PerGraph(Generic[T]):
    """``compute(graph)`` cached by graph identity while ``len(graph.ops)`` is unchanged.

    The solver, the simulator and the pipeline planner ask structural questions of one graph
    (which edges fuse, which phase an op is in) many times; a graph that gains ops (stamping,
    pipeline splitting) is analysed again. At most ``size`` graphs are kept."""

    def __init__(self, compute: Callable[[Graph], T], size: int = 16) -> None:
        self.compute = compute
        self.size = size
        self.cache: dict[int, tuple[Graph, int, T]] = {}

    def __call__(self, graph: Graph) -> T:
        hit = self.cache.get(id(graph))
        if hit is not None and hit[0] is graph and hit[1] == len(graph.ops):
            return hit[2]
        if len(self.cache) >= self.size:
            self.cache.clear()
        result = self.compute(graph)
        self.cache[id(graph)] = (graph, len(graph.ops), result)
        return result
