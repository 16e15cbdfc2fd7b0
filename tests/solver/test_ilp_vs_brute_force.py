"""The CP-SAT plan equals brute force over every strategy combination on small random graphs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from shardplan.costmodel import get_cluster
from shardplan.ir import Graph, Mesh, Role, TensorType
from shardplan.passes.merge_followers import follower_pairs
from shardplan.solver.axis_search import coordinates
from shardplan.solver.brute_force import brute_force
from shardplan.solver.costs import build_problem, build_space
from shardplan.solver.dominance import prune_dominated
from shardplan.solver.ilp import solve
from shardplan.solver.planner import evaluate_choice

MESHES = [Mesh({"x": 4}, cluster="cpu-test"), Mesh({"x": 2, "y": 2}, cluster="cpu-test")]


def random_graph(seed: int) -> Graph:
    """A seeded chain/DAG of matmuls, elementwise ops, reductions and reshapes."""
    rng = random.Random(seed)
    g = Graph(f"g{seed}")
    sizes = [4, 8, 16]
    x = g.add_input("x", TensorType((rng.choice(sizes), rng.choice(sizes))), Role.INPUT)
    values = [x]
    for step in range(rng.randint(2, 4)):
        v = rng.choice(values)
        kind = rng.choice(["dot", "dot", "relu", "add", "reduce_sum", "reshape"])
        rows, cols = v.type.shape if v.type.rank == 2 else (v.type.shape[0], 1)
        if v.type.rank != 2 and kind in ("dot", "reduce_sum", "reshape"):
            kind = "relu"
        if kind == "dot":
            w = g.add_input(f"w{step}", TensorType((cols, rng.choice(sizes))), Role.PARAMETER)
            out = g.add_op("dot", [v, w], [TensorType((rows, w.type.shape[1]))]).result
        elif kind == "add":
            same = [u for u in values if u.type == v.type]
            out = g.add_op("add", [v, rng.choice(same)], [v.type]).result
        elif kind == "reduce_sum":
            out = g.add_op("reduce_sum", [v], [TensorType((rows,))], attrs={"axes": (1,)}).result
        elif kind == "reshape":
            out = g.add_op("reshape", [v], [TensorType((rows * cols // 2, 2))]).result
        else:
            out = g.add_op(kind, [v], [v.type]).result
        values.append(out)
    g.set_outputs([values[-1]])
    return g


LIMIT = 400_000


def small_problem(seed: int, mesh: Mesh, merge: bool):
    """The first seeded graph from ``seed`` on whose problem brute force stays under LIMIT."""
    cluster = get_cluster(mesh.cluster)
    for offset in range(100):
        graph = random_graph(100 * seed + offset)
        graph.mesh = mesh
        space = build_space(graph, mesh)
        problem = build_problem(space, cluster, memory_limit=None)
        if merge:
            for follower, leader in follower_pairs(graph, space.producer, space.num_inputs):
                problem.eliminate(follower, leader, problem.follow_mapping(follower, leader))
        if math.prod(len(problem.node_costs[n]) for n in problem.live_nodes()) <= LIMIT:
            return space, problem, cluster
    raise AssertionError("no small graph found")


CASES = [(seed, mesh) for seed in range(12) for mesh in MESHES]


@pytest.mark.parametrize(("seed", "mesh"), CASES, ids=[f"{s}-{len(m.axes)}d" for s, m in CASES])
def test_ilp_objective_equals_brute_force(seed: int, mesh: Mesh) -> None:
    space, problem, cluster = small_problem(seed, mesh, merge=False)
    _, best = brute_force(problem, max_combinations=LIMIT)
    solution = solve(problem, time_limit=20)
    assert solution.status == "OPTIMAL"
    assert solution.objective == pytest.approx(best, rel=1e-6, abs=1e-12)
    # The plan's cost recomputed from the graph (not from the ILP's matrices) is the objective.
    assert evaluate_choice(space, cluster, solution.choice) == pytest.approx(
        solution.objective, rel=1e-9
    )


@pytest.mark.parametrize("seed", range(8))
def test_ilp_with_followers_equals_brute_force_of_merged_problem(seed: int) -> None:
    space, problem, cluster = small_problem(50 + seed, MESHES[1], merge=True)
    choice, best = brute_force(problem, max_combinations=LIMIT)
    solution = solve(problem, time_limit=20)
    assert solution.objective == pytest.approx(best, rel=1e-6, abs=1e-12)
    # Expanded followers are consistent: the full graph cost equals the merged objective.
    assert evaluate_choice(space, cluster, solution.choice) == pytest.approx(
        solution.objective, rel=1e-9
    )
    assert evaluate_choice(space, cluster, choice) == pytest.approx(best, rel=1e-9)


def test_ilp_respects_memory_limit() -> None:
    mesh = MESHES[0]
    g = Graph("mem")
    x = g.add_input("x", TensorType((16, 16)), Role.INPUT)
    w = g.add_input("w", TensorType((16, 16)), Role.PARAMETER)
    g.set_outputs([g.add_op("dot", [x, w], [TensorType((16, 16))]).result])
    space = build_space(g, mesh)
    cluster = get_cluster(mesh.cluster)
    problem = build_problem(space, cluster, memory_limit=2 * 16 * 16 * 4 / 4)  # both must shard
    solution = solve(problem)
    assert problem.memory_of(solution.choice) <= problem.memory_limit
    _, best = brute_force(problem)
    assert solution.objective == pytest.approx(best, rel=1e-6)


MESH_3D = Mesh({"x": 2, "y": 2, "z": 2}, cluster="cpu-test")


def neighbourhood_problem(seed: int, center_of: str):
    """A seeded graph on a 3-D mesh, strategies within one axis of a centre (the axis search's
    space): the replicated plan, or each node's first full-space strategy (a sharded one)."""
    cluster = get_cluster(MESH_3D.cluster)
    for offset in range(100):
        graph = random_graph(100 * seed + offset)
        graph.mesh = MESH_3D
        full = build_space(graph, MESH_3D)
        nodes = len(full.strategies)
        if center_of == "replicated":
            center = [(None,) * 3] * nodes
        else:
            center = coordinates(full, [len(s) // 2 for s in full.strategies])
        space = build_space(graph, MESH_3D, around=center)
        problem = build_problem(space, cluster, memory_limit=None)
        if math.prod(len(problem.node_costs[n]) for n in problem.live_nodes()) <= LIMIT:
            return space, problem, cluster
    raise AssertionError("no small graph found")


@pytest.mark.parametrize("center_of", ["replicated", "sharded"])
@pytest.mark.parametrize("seed", range(6))
def test_ilp_equals_brute_force_on_3d_neighbourhoods(seed: int, center_of: str) -> None:
    space, problem, cluster = neighbourhood_problem(200 + seed, center_of)
    unpruned = problem.copy()
    _, best = brute_force(unpruned, max_combinations=LIMIT)
    solution = solve(problem, time_limit=20)  # prunes dominated strategies first
    assert solution.status == "OPTIMAL"
    assert solution.objective == pytest.approx(best, rel=1e-6, abs=1e-12)
    assert evaluate_choice(space, cluster, solution.choice) == pytest.approx(
        solution.objective, rel=1e-9
    )


@pytest.mark.parametrize("seed", range(6))
def test_ilp_equals_brute_force_on_full_3d_space(seed: int) -> None:
    """Every strategy of a 3-D mesh (no neighbourhood), on graphs small enough to enumerate."""
    cluster = get_cluster(MESH_3D.cluster)
    for offset in range(200):
        graph = random_graph(1000 * (seed + 1) + offset)
        graph.mesh = MESH_3D
        space = build_space(graph, MESH_3D)
        problem = build_problem(space, cluster, memory_limit=None)
        if math.prod(len(problem.node_costs[n]) for n in problem.live_nodes()) <= LIMIT:
            break
    else:
        pytest.fail("no small graph found")
    _, best = brute_force(problem.copy(), max_combinations=LIMIT)
    solution = solve(problem, time_limit=20)
    assert solution.objective == pytest.approx(best, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_dominance_pruning_keeps_the_optimum(seed: int) -> None:
    """Forbidding dominated strategies never changes the brute-force optimum."""
    _, problem, _ = small_problem(300 + seed, MESHES[1], merge=False)
    _, before = brute_force(problem.copy(), max_combinations=LIMIT)
    pruned = problem.copy()
    prune_dominated(pruned)
    _, after = brute_force(pruned, max_combinations=LIMIT)
    assert after == pytest.approx(before, rel=1e-12, abs=1e-15)
    assert all(np.isfinite(c).any() for c in pruned.node_costs)
