"""Plans of random small graphs on random meshes (issue 14 point 3, hypothesis).

Each example builds a graph with ``GraphBuilder`` (matrix products, elementwise ops, reductions,
reshapes, transposes, softmax; parameters and batch inputs), plans it on a random mesh of at
most 8 devices (1-D, 2-D or 3-D) and checks, independently of the planner's enumeration:

- the plan verifies: every value and operand has a layout that fits its type on the mesh
  (divisibility, each axis at most once), every op's operand and result layouts come from one
  assignment of mesh axes to the factors of its rule, results are partial exactly over the
  axes of sharded reduction factors (plus pending sums a linear op passes through), inputs and
  outputs are never partial, and every edge whose layout changes has a reshard whose
  collectives are the cost model's for that edge;
- the JSON round-trips byte for byte, and the loaded plan's step time equals the planned one;
- the step time re-evaluates from the saved file: the two-stream simulation of the loaded plan
  gives the saved exposed communication and the saved compute time.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from shardplan.costmodel import get_cluster, reshard
from shardplan.costmodel.simulate import simulate
from shardplan.ir import GraphBuilder, Mesh, Role, Sharding, op_info
from shardplan.solver.planner import plan_graph
from shardplan.solver.serialize import plan_from_json, plan_to_json

EXAMPLES = int(os.environ.get("SHARDPLAN_PLAN_EXAMPLES", "1000"))
"""Examples per run (CI: 1000; set the variable lower for a quick local run)."""
CLUSTER = "h100-sxm"
AXES = ("a", "b", "c")
MESH_SHAPES = {
    1: [(2,), (4,), (8,), (3,), (6,)],
    2: [(2, 2), (2, 4), (4, 2), (2, 3), (1, 4)],
    3: [(2, 2, 2), (2, 1, 4), (1, 2, 3)],
}
"""Every mesh of at most 8 devices by rank, odd sizes and size-1 axes included."""
SIZES = [1024, 64, 4096, 12, 8192, 6, 3, 2, 1, 4]
"""Dimension sizes: small odd ones test divisibility, large ones make sharding pay."""
MAX_ELEMENTS = 2**26


@st.composite
def meshes(draw: st.DrawFn) -> Mesh:
    shape = draw(st.sampled_from(MESH_SHAPES[draw(st.sampled_from(sorted(MESH_SHAPES)))]))
    return Mesh(dict(zip(AXES, shape, strict=False)), cluster=CLUSTER)


@st.composite
def _pins(draw: st.DrawFn, shape: tuple[int, ...], mesh: Mesh) -> Sharding | None:
    """Sometimes a user pin (GSPMD-style) on an input: one mesh axis on one dim, if it fits."""
    if draw(st.integers(0, 4)) != 0:
        return None
    dim = draw(st.integers(0, len(shape) - 1))
    axis = draw(st.sampled_from(mesh.axis_names))
    if shape[dim] % mesh.axis_size(axis):
        return None
    return Sharding(tuple((axis,) if d == dim else () for d in range(len(shape))))


@st.composite
def graphs(draw: st.DrawFn, mesh: Mesh):
    """A small random graph: 1-3 inputs, 2-7 ops, a scalar loss and maybe another output."""
    b = GraphBuilder("random", mesh)
    values = []
    for i in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(1, 3))
        shape = [draw(st.sampled_from(SIZES)) for _ in range(rank)]
        while math.prod(shape) > MAX_ELEMENTS:  # every tensor fits a device many times over
            shape[shape.index(max(shape))] = 64
        role = draw(st.sampled_from([Role.INPUT, Role.PARAMETER]))
        pin = draw(_pins(tuple(shape), mesh))
        values.append(b.input(f"in{i}", shape, "bf16", role, sharding=pin, pinned=pin is not None))
    for _ in range(draw(st.integers(2, 7))):
        values.append(_random_op(draw, b, values))
    loss = b.reduce_sum(values[-1], axes=tuple(range(values[-1].type.rank)))
    outputs = [loss]
    if draw(st.booleans()) and values[-2:-1] and values[-2].producer is not None:
        outputs.append(values[-2])
    b.output(*outputs)
    return b.build()


@st.composite
def cases(draw: st.DrawFn):
    mesh = draw(meshes())
    return draw(graphs(mesh)), mesh


def _random_op(draw: st.DrawFn, b: GraphBuilder, values: list):
    x = draw(st.sampled_from(values))
    shape = x.type.shape
    kind = draw(st.sampled_from(["dot", "add", "mul", "relu", "exp", "reduce", "reshape",
                                 "transpose", "softmax", "norm"]))  # fmt: skip
    if kind == "dot" and x.type.rank == 3:  # a batched activation times a weight
        n = draw(st.sampled_from(SIZES))
        return b.matmul(x, b.param(f"w{len(values)}", (shape[2], n), "bf16"))
    if kind == "norm":
        return b.layer_norm(x, b.param(f"g{len(values)}", shape[-1:], "bf16"))
    if kind == "dot" and x.type.rank == 2:
        n = draw(st.sampled_from(SIZES))
        other = [v for v in values if v.type.shape == (shape[1], n)]
        w = other[0] if other else b.param(f"w{len(values)}", (shape[1], n), "bf16")
        return b.dot(x, w)
    if kind in ("add", "mul"):
        same = [v for v in values if v.type.shape == shape and v is not x]
        y = draw(st.sampled_from(same)) if same else b.param(f"p{len(values)}", shape, "bf16")
        return b.add(x, y) if kind == "add" else b.mul(x, y)
    if kind == "reduce" and x.type.rank >= 2:
        return b.reduce_sum(x, axes=draw(st.integers(0, x.type.rank - 1)))
    if kind == "reshape" and x.type.rank >= 2:
        return b.reshape(x, (shape[0] * shape[1], *shape[2:]))  # merge the two major dims
    if kind == "reshape" and x.type.rank == 1 and shape[0] % 2 == 0 and shape[0] > 2:
        return b.reshape(x, (2, shape[0] // 2))  # split a dim (a compound factor)
    if kind == "transpose" and x.type.rank >= 2:
        return b.transpose(x, tuple(reversed(range(x.type.rank))))
    if kind == "softmax":
        return b.softmax(x)
    return b.exp(x) if kind == "exp" else b.relu(x)


# -- an independent legality check ---------------------------------------------------------------
def _assignments(rule, mesh: Mesh):
    """Every map of mesh axes (size > 1) to at most one factor each: Shardy's definition, with
    no pruning (the check accepts any legal choice, not only those the planner enumerates)."""
    axes = [a for a, n in mesh.axes if n > 1]
    factors = rule.factor_names
    for choice in itertools.product([None, *factors], repeat=len(axes)):
        assign: dict[str, tuple[str, ...]] = {}
        for axis, factor in zip(axes, choice, strict=True):
            if factor is not None:
                assign[factor] = (*assign.get(factor, ()), axis)
        yield assign


def _layout(factors, assign) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(a for f in dim for a in assign.get(f, ())) for dim in factors)


def _legal_assignment(rule, assign, mesh: Mesh) -> bool:
    size = rule.size_of
    if any(f in rule.need_replication for f in assign):
        return False
    if any(size[f] % mesh.group_size(axes) for f, axes in assign.items()):
        return False  # an uneven split of a factor
    for tensor in rule.operands + rule.results:  # a minor factor of a compound dim may be
        for dim in tensor:  # split only when every more-major one is split completely
            for k, f in enumerate(dim):
                if assign.get(f) and any(
                    mesh.group_size(assign.get(g, ())) != size[g] for g in dim[:k]
                ):
                    return False
    return True


def _check_op(plan, i: int, op, produced: dict) -> None:
    """The op's operand and result layouts come from one legal factor assignment."""
    operands = [plan.operand_shardings[(i, j)] for j in range(len(op.operands))]
    results = [produced.get(r.name, plan.shardings[r.name]) for r in op.results]
    pending = {s.partial for s in operands}
    assert len(pending) <= 1, f"op {i} {op.kind}: operands pending over different axes"
    extra = next(iter(pending), frozenset())
    linear = bool(op_info(op.kind) and op_info(op.kind).linear)
    assert not extra or linear, f"op {i} {op.kind} is not linear but takes a pending sum"
    rule = op.rule
    for assign in _assignments(rule, plan.mesh):
        if [s.dims for s in operands] != [_layout(t, assign) for t in rule.operands]:
            continue
        if [s.dims for s in results] != [_layout(t, assign) for t in rule.results]:
            continue
        reduced = frozenset(a for f in rule.reduction for a in assign.get(f, ()))
        assert all(s.partial == reduced | extra for s in results), (i, op.kind, assign)
        assert _legal_assignment(rule, assign, plan.mesh), (i, op.kind, assign)
        return
    raise AssertionError(f"op {i} {op.kind}: no factor assignment gives {operands} -> {results}")


def check_plan(plan) -> None:
    mesh, graph = plan.mesh, plan.graph
    cluster = get_cluster(mesh.cluster)
    types = {v.name: v.type for v in graph.values()}
    for name, s in plan.shardings.items():
        s.check(types[name], mesh)  # divisibility; Sharding itself refuses a reused axis
    assert set(plan.shardings) == set(types)
    for v in graph.inputs:
        assert not plan.shardings[v.name].partial, f"input %{v.name} is partial"
    for s in plan.output_shardings:
        assert not s.partial, "a graph output is left partial"
    produced = {
        r.value: r.src for r in plan.reshards if r.consumer.split(":")[0] in ("pin", "reduce")
    }
    for i, op in enumerate(graph.ops):
        for j, v in enumerate(op.operands):
            plan.operand_shardings[(i, j)].check(v.type, mesh)
        _check_op(plan, i, op, produced)
    edges = {r.consumer: r for r in plan.reshards}
    for i, op in enumerate(graph.ops):
        for j, v in enumerate(op.operands):
            src, dst = plan.shardings[v.name], plan.operand_shardings[(i, j)]
            r = edges.get(f"op:{i}:{j}")
            assert (r is None) == (src == dst), f"op {i} operand {j}: reshard missing or extra"
            if r is not None:
                assert (r.value, r.src, r.dst) == (v.name, src, dst)
    for r in plan.reshards:  # the saved collectives are the cost model's for the edge
        assert r.collectives == tuple(reshard(r.src, r.dst, types[r.value], mesh, cluster))


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(case=cases())
def test_random_plans_verify_round_trip_and_re_evaluate(case) -> None:
    graph, mesh = case
    plan = plan_graph(graph, mesh, time_limit=5.0)
    event("pinned" if any(v.pinned for v in graph.inputs) else "no pin")
    event(f"mesh rank {len(mesh.axes)}")
    event(f"{len(graph.ops)} ops")
    event("reshards" if plan.reshards else "no reshard")
    event("partial value" if any(s.partial for s in plan.shardings.values()) else "no partial")
    event("sharded" if any(s.used_axes for s in plan.shardings.values()) else "all replicated")
    check_plan(plan)
    text = plan_to_json(plan)
    loaded = plan_from_json(text)
    assert plan_to_json(loaded) == text
    assert loaded.step_time == plan.step_time
    check_plan(loaded)
    # re-evaluated from the file alone: the simulator on the loaded plan
    again = simulate(loaded)
    assert math.isclose(
        again.exposed_comm_time, plan.exposed_comm_time, rel_tol=1e-9, abs_tol=1e-15
    )
    assert math.isclose(again.compute_time, plan.compute_time, rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(again.step_time, plan.step_time, rel_tol=1e-9, abs_tol=1e-15)


def _mlp_plan():
    b = GraphBuilder("mlp")
    x = b.input("x", (64, 1024), "bf16")
    w = b.param("w", (1024, 4096), "bf16")
    h = b.relu(b.dot(x, w))
    b.output(b.reduce_sum(h, axes=(0, 1)))
    return plan_graph(b.build(), Mesh({"a": 2, "b": 4}, cluster=CLUSTER), time_limit=5.0)


def _with(plan, **changed: dict):  # type: ignore[no-untyped-def]
    """A copy of ``plan`` (immutable) with entries of its tables replaced."""
    return dataclasses.replace(
        plan, **{field: {**getattr(plan, field), **entries} for field, entries in changed.items()}
    )


def test_the_check_rejects_broken_plans() -> None:
    """The legality check is not vacuous: each kind of corruption is caught."""
    check_plan(_mlp_plan())
    plan = _mlp_plan()  # an operand layout no factor assignment explains with the result
    dot = next(i for i, op in enumerate(plan.graph.ops) if op.kind == "dot")
    broken = _with(plan, operand_shardings={(dot, 1): Sharding.of("b", "a")})
    with pytest.raises(AssertionError):
        check_plan(broken)
    broken = _with(_mlp_plan(), shardings={"w": Sharding.of(None, None, partial=["a"])})
    with pytest.raises(AssertionError):
        check_plan(broken)
    plan = _mlp_plan()  # a layout change with no reshard
    name = plan.graph.ops[dot].operands[0].name
    before = plan.shardings[name]
    moved = Sharding.of(None, None) if before.used_axes else Sharding.of("a", None)
    broken = _with(plan, shardings={name: moved})
    with pytest.raises(AssertionError):
        check_plan(broken)
