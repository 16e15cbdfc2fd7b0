"""Elementwise fusion: which intermediates stay on chip, and the bytes and times that follow."""

from __future__ import annotations

import pytest
from shardplan.costmodel import compute_time, get_cluster, reshard_time
from shardplan.costmodel.fusion import fusion, unfused_penalty
from shardplan.costmodel.op_times import plan_op_times
from shardplan.ir import Graph, Mesh, Role, Sharding, TensorType
from shardplan.solver.costs import build_problem, build_space
from shardplan.solver.planner import plan_graph

ROWS, COLS = 4096, 4096
F32 = TensorType((ROWS, COLS), "f32")
BF16 = TensorType((ROWS, COLS), "bf16")


def chain() -> Graph:
    """``y = exp(x * s + b)`` in f32, cast to bf16, read by a GEMM: mul -> add -> exp -> convert."""
    g = Graph(name="chain")
    x = g.add_input("x", F32, Role.INPUT)
    s = g.add_input("s", F32, Role.INPUT)
    b = g.add_input("b", F32, Role.INPUT)
    w = g.add_input("w", TensorType((COLS, 256), "bf16"), Role.PARAMETER)
    m = g.add_op("mul", [x, s], [F32], names=["m"]).result
    a = g.add_op("add", [m, b], [F32], names=["a"]).result
    e = g.add_op("exp", [a], [F32], names=["e"]).result
    c = g.add_op("convert", [e], [BF16], names=["c"]).result
    y = g.add_op("dot", [c, w], [TensorType((ROWS, 256), "bf16")], names=["y"]).result
    g.set_outputs([y])
    return g


def _names(g: Graph) -> dict[str, tuple[tuple[bool, ...], tuple[bool, ...]]]:
    fused = fusion(g)
    return {
        op.results[0].name: (f.on_chip_operands, f.on_chip_results)
        for op in g.ops
        if (f := fused.of(op)) is not None
    }


def test_fusion_chain_keeps_intermediates_on_chip():
    """Each single-reader elementwise intermediate is fused; the GEMM's operand is written."""
    marks = _names(chain())
    assert marks["m"] == ((False, False), (True,))
    assert marks["a"] == ((True, False), (True,))
    assert marks["e"] == ((True,), (True,))
    assert marks["c"] == ((True,), (False,))  # the dot is no fusion partner: c goes to HBM
    assert "y" not in marks


def test_fusion_chain_bytes_equal_the_fused_kernel():
    """On one device the chain moves x, s, b in and c out, nothing else: mul reads x and s,
    add reads b, exp touches no HBM, convert writes c; only convert launches a kernel (floor)."""
    g = chain()
    plan = plan_graph(g, Mesh({"x": 1}, cluster="h100-sxm"), overlap=False)
    cluster = get_cluster("h100-sxm")
    bandwidth = cluster.hbm_bandwidth * cluster.memory_efficiency
    times = plan_op_times(plan)
    assert times[0] == pytest.approx(2 * F32.nbytes / bandwidth)
    assert times[1] == pytest.approx(F32.nbytes / bandwidth)
    assert times[2] == pytest.approx(compute_time(ROWS * COLS, 0, "f32", cluster, launches=False))
    assert times[2] < cluster.kernel_floor
    assert times[3] == pytest.approx(max(BF16.nbytes / bandwidth, cluster.kernel_floor))
    # unfused: mul r2 w1, add r2 w1, exp r1 w1, convert r1 (f32) w1 (bf16)
    unfused = (3 + 3 + 2 + 1) * F32.nbytes + BF16.nbytes
    fused = 3 * F32.nbytes + BF16.nbytes  # read x, s, b; write c
    assert sum(times[:4]) == pytest.approx(fused / bandwidth + times[2])
    assert fused < unfused / 2


def test_fusion_value_with_two_readers_is_written():
    """A value read by two ops (as a forward value saved for backward) is not fused."""
    g = Graph(name="fanout")
    x = g.add_input("x", F32, Role.INPUT)
    m = g.add_op("mul", [x, x], [F32], names=["m"]).result
    a = g.add_op("exp", [m], [F32], names=["a"]).result
    b = g.add_op("tanh", [m], [F32], names=["b"]).result
    s = g.add_op("add", [a, b], [F32], names=["s"]).result
    g.set_outputs([s])
    marks = _names(g)
    assert "m" not in marks  # two readers
    assert marks["a"] == ((False,), (True,))
    assert marks["s"] == ((True, True), (False,))


def test_fusion_broadcast_reader_and_graph_output_are_written():
    g = Graph(name="broadcast")
    x = g.add_input("x", TensorType((ROWS, 1), "f32"), Role.INPUT)
    big = g.add_input("big", F32, Role.INPUT)
    r = g.add_op("rsqrt", [x], [TensorType((ROWS, 1), "f32")], names=["r"]).result
    wide = g.add_op("broadcast_in_dim", [r], [F32], attrs={"dims": (0, 1)}, names=["wide"])
    y = g.add_op("mul", [wide.result, big], [F32], names=["y"]).result
    z = g.add_op("exp", [y], [F32], names=["z"]).result
    g.set_outputs([y, z])
    marks = _names(g)
    assert "r" not in marks  # its reader reads it broadcast to ROWS x COLS
    assert "y" not in marks  # a graph output is written


def test_fusion_penalty_prices_a_reshard_inside_a_chain():
    """A layout change on a fused edge costs the write and the read it forces: the closed
    form, and the solver's price of the mul -> add edge is the reshard plus that penalty."""
    mesh = Mesh({"x": 4}, cluster="h100-sxm")
    cluster = get_cluster("h100-sxm")
    split, whole = Sharding((("x",), ())), Sharding(((), ()))
    bandwidth = cluster.hbm_bandwidth * cluster.memory_efficiency
    expected = max(F32.nbytes / 4 / bandwidth, cluster.kernel_floor) + F32.nbytes / bandwidth
    assert unfused_penalty(F32, split, whole, mesh, cluster) == pytest.approx(expected)
    assert unfused_penalty(F32, split, split, mesh, cluster) == 0.0
    g = chain()
    g.mesh = mesh
    space = build_space(g, mesh)
    problem = build_problem(space, cluster, None)
    assert (1, 0) in space.fusion.edges  # m -> add, operand 0
    mul, add = space.op_node(0), space.op_node(1)
    (edge,) = [e for e in problem.edges if (e.u, e.v) == (mul, add)]
    for su, produced in enumerate(space.strategies[mul]):
        for sv, consumed in enumerate(space.strategies[add]):
            src, dst = produced.results[0], consumed.operands[0]
            price = reshard_time(src, dst, F32, mesh, cluster)
            price += unfused_penalty(F32, src, dst, mesh, cluster)
            assert edge.value(su, sv) == pytest.approx(price)
