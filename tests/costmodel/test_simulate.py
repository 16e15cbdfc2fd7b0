"""Two-stream step simulation: closed forms on toy graphs, phases, and the planner's proxy."""

from __future__ import annotations

from dataclasses import replace

import pytest
from shardplan.costmodel import get_cluster
from shardplan.costmodel.collectives import Collective
from shardplan.costmodel.comm_streams import link_rank, reshard_link
from shardplan.costmodel.exposure import (
    GRADIENT_EXPOSURE,
    PREFETCH_EXPOSURE,
    edge_exposure,
    weight_edges,
)
from shardplan.costmodel.op_times import plan_op_times
from shardplan.costmodel.phases import Phase, layer_blocks, op_phases
from shardplan.costmodel.simulate import (
    SimulationOptions,
    Transfer,
    serial_result,
    shared_reshards,
    simulate,
    simulate_graph,
    stored_view,
)
from shardplan.ir import Graph, Mesh, Origin, Role, Sharding, TensorType
from shardplan.ir.builder import GraphBuilder
from shardplan.passes.liveness import op_phases as liveness_op_phases
from shardplan.solver.costs import build_problem, build_space
from shardplan.solver.ilp import solve
from shardplan.solver.planner import build_plan, plan_graph


def deep_linear(layers: int = 4, batch: int = 64, width: int = 64, dtype: str = "bf16") -> Graph:
    """``h_{k+1} = h_k @ w_k``, a sum loss, backward, and SGD updates aliased to the weights."""
    g = Graph(name="deep_linear")

    def t(*shape: int) -> TensorType:
        return TensorType(shape, dtype)

    def op(kind, *operands, shape, name, module, **attrs):
        origin = Origin(module=module)
        return g.add_op(kind, operands, [t(*shape)], attrs=attrs, origin=origin, names=[name])

    x = g.add_input("x", t(batch, width), Role.INPUT, Origin(path="x"))
    ws = [
        g.add_input(f"w{k}", t(width, width), Role.PARAMETER, Origin(path=f"layers.{k}.w"))
        for k in range(layers)
    ]
    hs = [x]
    for k, w in enumerate(ws):
        hs.append(
            op(
                "dot", hs[-1], w, shape=(batch, width), name=f"h{k + 1}", module=f"layers.{k}"
            ).result
        )
    loss = op("reduce_sum", hs[-1], shape=(), name="loss", module="loss", axes=(0, 1)).result
    grad = op("add", hs[-1], hs[-1], shape=(batch, width), name="g_out", module="loss").result
    gws = {}
    for k in reversed(range(layers)):
        gws[k] = op(
            "einsum", hs[k], grad, shape=(width, width), name=f"g_w{k}", module=f"layers.{k}",
            equation="bi,bj->ij",
        ).result  # fmt: skip
        if k:
            grad = op(
                "einsum", grad, ws[k], shape=(batch, width), name=f"g_h{k}",
                module=f"layers.{k}", equation="bj,ij->bi",
            ).result  # fmt: skip
    news = [
        op("sub", ws[k], gws[k], shape=(width, width), name=f"w{k}_new", module="sgd").result
        for k in range(layers)
    ]
    g.set_outputs([loss, *news], aliases={j + 1: j + 1 for j in range(layers)})
    return g


def _op(graph: Graph, name: str):
    return graph.value(name).producer


def test_simulate_phases_from_structure():
    g = deep_linear(layers=2)
    phases = {op.results[0].name: p for op, p in op_phases(g).items()}
    assert phases["h1"] is Phase.FORWARD
    assert phases["loss"] is Phase.FORWARD
    assert phases["g_w1"] is Phase.BACKWARD
    assert phases["g_h1"] is Phase.BACKWARD
    assert phases["w0_new"] is Phase.UPDATE
    assert phases["w1_new"] is Phase.UPDATE


def test_a_weight_gradient_of_a_transposed_activation_is_backward():
    """``g_w2 = a^T @ g_h``, where ``a^T`` is a backward-time view (reshape, then transpose) of
    the saved activation: the matmul reads no forward value itself, only a view of one and a
    gradient (an MoE expert's weight gradient reads its dispatch buffer so). It is backward, in
    the cost model's and in liveness's classification alike; the SGD step stays update."""
    b = GraphBuilder("transposed_activation")
    x = b.input("x", (8, 16))
    w1, w2 = b.param("w1", (16, 32)), b.param("w2", (32, 16))
    a = b.reshape(b.relu(b.dot(x, w1)), (2, 4, 32))  # saved for backward
    h = b.matmul(a, w2)
    loss = b.reduce_sum(b.mul(h, h), axes=(0, 1, 2))
    g_h = b.reshape(b.add(h, h), (8, 16))
    a_t = b.transpose(b.reshape(a, (8, 32)), (1, 0))
    g_w2 = b.dot(a_t, g_h)
    b.output(loss, b.sub(w2, g_w2), aliases={1: 2})
    graph = b.build()
    phases = op_phases(graph)
    assert phases[g_w2.producer] is Phase.BACKWARD
    assert phases[a_t.producer] is Phase.BACKWARD
    assert phases[graph.outputs[1].producer] is Phase.UPDATE
    assert phases[h.producer] is Phase.FORWARD
    assert liveness_op_phases(graph) == list(phases.values())


def test_simulate_inference_graph_is_all_forward():
    g = deep_linear(layers=2)
    g.set_outputs(g.outputs[:1])
    assert set(op_phases(g).values()) == {Phase.FORWARD}


def test_simulate_layer_blocks_follow_module_paths():
    g = deep_linear(layers=2)
    names = [op.results[0].name for op in g.ops]
    blocks = dict(zip(names, layer_blocks(g), strict=True))
    assert blocks["h1"] == 0
    assert blocks["h2"] == 1
    assert blocks["g_w1"] == 1  # backward of the last layer continues its forward block
    assert blocks["g_w0"] == 2


def test_simulate_critical_path_collectives_are_serial():
    """Each op's operand is resharded from its producer: nothing can overlap."""
    g = deep_linear(layers=4)
    times = [1.0] * len(g.ops)
    transfers = [
        Transfer(g.value(f"h{k}"), g.ops.index(_op(g, f"h{k + 1}")), 0.5) for k in (1, 2, 3)
    ]
    result = simulate_graph(g, times, transfers)
    assert result.step_time == pytest.approx(len(g.ops) + 1.5)
    assert result.exposed_comm_time == pytest.approx(1.5)
    assert result.overlapped_comm_time == pytest.approx(0.0)
    assert result.step_time == pytest.approx(serial_result(times, transfers).step_time)


@pytest.mark.parametrize("side", ["consumer", "producer"])
@pytest.mark.parametrize("c", [0.5, 2.0])
def test_simulate_tp_overlap_pipelines_a_collective_with_its_gemm(side, c):
    """A collective of ``c`` s chunked ``n`` ways with a ``g`` s GEMM (an all-gather into it,
    or a reduce-scatter out of it) is a two-stage pipeline: the pair takes
    ``max(c, g) + min(c, g) / n``, so ``max(0, c - g) + min(c, g) / n`` is exposed."""
    g_time, n = 1.0, 4
    g = deep_linear(layers=4)
    times = [g_time] * len(g.ops)
    consumer = g.ops.index(_op(g, "h2"))
    plain = Transfer(g.value("h1"), consumer, c)
    chunked = Transfer(g.value("h1"), consumer, c, pipelined=side, chunks=n)
    serial = simulate_graph(g, times, [plain])
    result = simulate_graph(g, times, [chunked])
    exposed = max(0.0, c - g_time) + min(c, g_time) / n
    assert serial.exposed_comm_time == pytest.approx(c)
    assert result.exposed_comm_time == pytest.approx(exposed)
    assert result.step_time == pytest.approx(sum(times) + exposed)
    assert result.overlapped_comm_time == pytest.approx(c - exposed)
    one_chunk = Transfer(g.value("h1"), consumer, c, pipelined=side, chunks=1)
    assert simulate_graph(g, times, [one_chunk]).step_time == pytest.approx(serial.step_time)


def test_simulate_gradient_reductions_overlap_backward():
    """Gradient all-reduces (c <= one backward op) hide under backward; only the last shows."""
    layers, c = 4, 0.9
    g = deep_linear(layers=layers)
    times = [0.0 if op.kind == "sub" else 1.0 for op in g.ops]  # free updates
    transfers = [
        Transfer(g.value(f"g_w{k}"), g.ops.index(_op(g, f"w{k}_new")), c) for k in range(layers)
    ]
    result = simulate_graph(g, times, transfers)
    compute = sum(times)
    assert result.step_time == pytest.approx(compute + c)  # the last gradient, g_w0
    assert result.exposed_comm_time == pytest.approx(c)
    assert result.overlapped_comm_time == pytest.approx((layers - 1) * c)
    assert serial_result(times, transfers).step_time == pytest.approx(compute + layers * c)


@pytest.mark.parametrize("window", [1, None])
def test_simulate_parameter_prefetch_hides_all_but_the_first_gather(window):
    """Parameter all-gathers of ``a`` s against layers of ``f`` >= ``a`` s: only layer 0 waits."""
    layers, a = 4, 0.8
    g = deep_linear(layers=layers)
    times = [1.0] * len(g.ops)
    transfers = [
        Transfer(g.value(f"w{k}"), g.ops.index(_op(g, f"h{k + 1}")), a) for k in range(layers)
    ]
    result = simulate_graph(g, times, transfers, SimulationOptions(prefetch_window=window))
    assert result.step_time == pytest.approx(len(g.ops) + a)


def test_simulate_no_prefetch_window_zero_exposes_every_gather():
    layers, a = 4, 0.8
    g = deep_linear(layers=layers)
    times = [1.0] * len(g.ops)
    transfers = [
        Transfer(g.value(f"w{k}"), g.ops.index(_op(g, f"h{k + 1}")), a) for k in range(layers)
    ]
    result = simulate_graph(g, times, transfers, SimulationOptions(prefetch_window=0))
    assert result.step_time == pytest.approx(len(g.ops) + layers * a)


def test_simulate_slow_prefetch_is_bandwidth_bound():
    """Gathers longer than a layer queue back to back: step = L * a + the last layer's work."""
    layers, a = 4, 3.0
    g = deep_linear(layers=layers)
    times = [1.0] * len(g.ops)
    transfers = [
        Transfer(g.value(f"w{k}"), g.ops.index(_op(g, f"h{k + 1}")), a) for k in range(layers)
    ]
    result = simulate_graph(g, times, transfers, SimulationOptions(prefetch_window=None))
    assert result.step_time == pytest.approx(layers * a + (len(g.ops) - layers + 1))


def test_simulate_plan_matches_planner_compute_and_bounds_serial():
    g = deep_linear(layers=2, batch=256, width=512)
    plan = plan_graph(g, Mesh({"dp": 4}, cluster="h100-sxm"))
    result = simulate(plan)
    assert result.compute_time == pytest.approx(plan.compute_time)
    assert result.comm_time == pytest.approx(plan.comm_time)
    assert result.compute_time <= result.step_time <= plan.step_time + 1e-12


def test_simulate_edge_exposure_classes():
    g = deep_linear(layers=2)
    assert edge_exposure(g.value("w0"), _op(g, "h1"), g) == PREFETCH_EXPOSURE
    assert edge_exposure(g.value("g_w0"), _op(g, "w0_new"), g) == GRADIENT_EXPOSURE
    assert edge_exposure(g.value("h1"), _op(g, "h2"), g) == 1.0
    assert edge_exposure(g.value("g_out"), _op(g, "g_w1"), g) == 1.0
    assert edge_exposure(g.value("x"), _op(g, "h1"), g) == 1.0


def _solve(graph: Graph, mesh: Mesh, overlap_aware: bool):
    graph.mesh = mesh
    cluster = get_cluster(mesh.cluster)
    space = build_space(graph, mesh)
    problem = build_problem(space, cluster, None)
    if overlap_aware:
        weight_edges(problem, space)
    return build_plan(space, cluster, solve(problem, time_limit=20), problem)


def test_simulate_overlap_aware_objective_changes_the_plan():
    """A wide 4-layer linear stack on 8 H100s: the serial objective and the exposure-weighted
    one pick different layouts, and the weighted pick simulates faster."""
    mesh = Mesh({"x": 8}, cluster="h100-sxm")
    serial = _solve(deep_linear(4, 16384, 65536), mesh, overlap_aware=False)
    aware = _solve(deep_linear(4, 16384, 65536), mesh, overlap_aware=True)
    assert serial.shardings != aware.shardings
    assert simulate(aware).step_time < 0.95 * simulate(serial).step_time
    assert serial.step_time < aware.step_time  # the serial objective would have refused it


def two_readers() -> Graph:
    """``x`` split by rows feeds two column-parallel GEMMs (like a norm output feeding q and k):
    both want it whole, so the plan lists the same all-gather on two edges."""
    mesh = Mesh({"tp": 4}, cluster="h100-sxm")
    g = Graph(name="two_readers")
    rows = Sharding((("tp",), ()))
    columns = Sharding(((), ("tp",)))
    x = g.add_input("x", TensorType((256, 1024), "bf16"), Role.INPUT, sharding=rows, pinned=True)
    ws = [
        g.add_input(name, TensorType((1024, 4096), "bf16"), Role.PARAMETER, sharding=columns,
                    pinned=True)
        for name in ("wq", "wk")
    ]  # fmt: skip
    out = TensorType((256, 4096), "bf16")
    q, k = (g.add_op("dot", [x, w], [out], names=[n]).result for w, n in zip(ws, "qk", strict=True))
    y = g.add_op("add", [q, k], [out], names=["y"]).result
    g.set_outputs([y])
    g.mesh = mesh
    return g


def test_shared_reshards_point_later_readers_at_the_first():
    from shardplan.solver.plan import Reshard

    a, b = Sharding((("tp",), ())), Sharding(((), ()))
    reshards = [
        Reshard("x", "op:1:0", a, b, ()),
        Reshard("x", "op:2:0", a, b, ()),
        Reshard("x", "op:3:0", a, Sharding(((), ("tp",))), ()),
        Reshard("y", "op:3:1", a, b, ()),
        Reshard("x", "output:0", a, b, ()),
        Reshard("x", "alias:1", a, b, ()),
    ]
    assert shared_reshards(reshards) == [None, 0, None, None, 0, None]


def test_simulate_charges_one_gather_for_two_readers():
    """Two readers of one value in one layout share the all-gather: one transfer runs, and the
    plan's communication counts it once, though ``plan.reshards`` lists both edges."""
    g = two_readers()
    plan = plan_graph(g, g.mesh, overlap=False)
    gathers = [r for r in plan.reshards if r.value == "x"]
    assert len(gathers) == 2  # the setup: one all-gather listed per reader
    assert gathers[0].dst == gathers[1].dst
    result = simulate(plan)
    assert result.comm_time == pytest.approx(gathers[0].time)
    assert plan.comm_time == pytest.approx(gathers[0].time)
    compute = sum(plan_op_times(plan))
    assert result.step_time == pytest.approx(compute + gathers[0].time)


def test_simulate_shared_transfer_releases_every_reader():
    """``Transfer.also``: the second reader waits for the first reader's transfer."""
    g = deep_linear(layers=2)
    h1 = g.value("h1")
    readers = [g.ops.index(u.op) for u in h1.uses]
    first, later = readers[0], readers[1:]
    times = [1.0] * len(g.ops)
    transfers = [Transfer(h1, first, 2.5, also=tuple(later))]
    result = simulate_graph(g, times, transfers)
    assert result.comm_time == pytest.approx(2.5)
    assert result.step_time == pytest.approx(len(g.ops) + 2.5)


def test_simulate_collectives_on_different_links_run_concurrently():
    """Issue 41: an FSDP gather over the NICs and a tensor-parallel collective on NVLink are two
    NCCL communicators: they overlap. On one link (or with ``concurrent_links=False``) they
    take turns. Two gradient reductions of ``c`` ending the step: c vs 2c exposed."""
    g = deep_linear(layers=2)
    times = [0.0 if op.kind == "sub" else 1.0 for op in g.ops]
    c = 5.0
    consumers = [g.ops.index(_op(g, f"w{k}_new")) for k in range(2)]
    on = [Transfer(g.value(f"g_w{k}"), consumers[k], c, link=link)
          for k, link in enumerate(("inter-node", "intra-node"))]  # fmt: skip
    shared = [Transfer(t.value, t.consumer, c, link="inter-node") for t in on]
    compute = sum(times)
    timeline: list[tuple[str, int, float, float]] = []
    concurrent = simulate_graph(g, times, on, timeline=timeline)
    turns = simulate_graph(g, times, shared)
    one_stream = simulate_graph(g, times, on, SimulationOptions(concurrent_links=False))
    # g_w1 is produced before g_w0, which ends the backward: on two links the reductions
    # overlap, so only g_w0's shows; on one link g_w0's waits for g_w1's to finish
    producer = _op(g, "g_w1")
    first = next(end for kind, i, _, end in timeline if kind == "compute" and g.ops[i] is producer)
    assert first < compute
    assert concurrent.step_time == pytest.approx(compute + c)
    assert turns.step_time == pytest.approx(first + 2 * c)
    assert one_stream.step_time == pytest.approx(turns.step_time)


def test_simulate_prefetches_a_gather_of_a_parameter_view():
    """A gather of a weight's transpose moves the stored parameter: it is prefetched like a
    gather of the parameter itself (the transpose is a view of the gathered buffer)."""
    g = deep_linear(layers=1)
    w = g.value("w0")
    h1 = _op(g, "h1")
    view = g.add_op("transpose", [w], [w.type], attrs={"permutation": (1, 0)},
                    origin=Origin(module="layers.0"), names=["w0_t"]).result  # fmt: skip
    assert stored_view(view)
    assert stored_view(w)
    assert not stored_view(h1.result)


def test_reshard_link_is_the_outermost_level_crossed():
    """8 GPUs a node: ``tp`` (minor, 8) stays on NVLink, ``dp`` crosses the NICs; a reshard
    with both rides the NICs; a local slice rides nothing."""
    mesh = Mesh({"dp": 4, "tp": 8}, cluster="h100-sxm")
    h100 = get_cluster("h100-sxm")
    tp, dp = Collective("all-gather", ("tp",), 1 << 20), Collective("all-gather", ("dp",), 1 << 20)
    assert reshard_link([tp], mesh, h100) == "intra-node"
    assert reshard_link([dp], mesh, h100) == "inter-node"
    assert reshard_link([tp, dp], mesh, h100) == "inter-node"
    assert reshard_link([], mesh, h100) == ""
    assert link_rank("inter-island-2") > link_rank("inter-island") > link_rank("inter-node")


def test_simulate_two_groups_on_one_link_share_it_while_both_run():
    """Two communicators on the NICs (processor sharing): the second collective, starting while
    the first has ``r`` left, runs at half speed for ``r`` and then alone: ``c + r``. The link
    never idles and moves both at full bandwidth: the step ends ``2c`` after the first starts."""
    g = deep_linear(layers=2)
    times = [0.0 if op.kind == "sub" else 1.0 for op in g.ops]
    c = 5.0
    consumers = [g.ops.index(_op(g, f"w{k}_new")) for k in range(2)]
    groups = [("dp",), ("ep",)]
    split = [Transfer(g.value(f"g_w{k}"), consumers[k], c, link="inter-node", group=groups[k])
             for k in range(2)]  # fmt: skip
    timeline: list[tuple[str, int, float, float]] = []
    result = simulate_graph(g, times, split, timeline=timeline)
    ends = {i: (a, b) for kind, i, a, b in timeline if kind == "comm"}
    (start1, end1), (start0, end0) = ends[1], ends[0]
    assert end1 - start1 == pytest.approx(c)  # g_w1 starts alone
    assert start1 < start0 < end1  # g_w0 starts while g_w1 is in flight
    assert end0 - start0 == pytest.approx(c + (end1 - start0))  # shared for what g_w1 has left
    assert result.step_time == pytest.approx(start1 + 2 * c)
    # a short collective in flight slows a long one by its remainder only, not by half
    late = [replace(split[0], time=4 * c), replace(split[1], time=c / 10)]
    timeline = []
    simulate_graph(g, times, late, timeline=timeline)
    ends = {i: (a, b) for kind, i, a, b in timeline if kind == "comm"}
    assert ends[0][1] - ends[0][0] == pytest.approx(4 * c + max(0.0, ends[1][1] - ends[0][0]))


def test_simulate_prefetch_stream_does_not_hold_up_a_collective_needed_now():
    """A parameter gathered ahead runs on its group's prefetch stream (FSDP's all-gather
    stream): a collective of the same group needed at once starts when its operand is ready and
    shares the link with the prefetch, instead of queueing behind it on one stream."""
    g = deep_linear(layers=3)
    times = [1.0] * len(g.ops)
    h2, h3 = (g.ops.index(_op(g, name)) for name in ("h2", "h3"))
    a = 10.0
    transfers = [
        Transfer(g.value("w2"), h3, a, link="inter-node", group=("dp",)),  # prefetched from t=0
        Transfer(g.value("h1"), h2, 1.0, link="inter-node", group=("dp",)),  # needed at t=1
    ]
    for concurrent, start in ((True, 1.0), (False, a)):
        timeline: list[tuple[str, int, float, float]] = []
        options = SimulationOptions(prefetch_window=None, concurrent_links=concurrent)
        simulate_graph(g, times, transfers, options, timeline=timeline)
        ends = {i: (s, e) for kind, i, s, e in timeline if kind == "comm"}
        assert ends[0][0] == pytest.approx(0.0)
        assert ends[1][0] == pytest.approx(start)
    assert ends[1][1] == pytest.approx(a + 1.0)  # one stream: after the prefetch
    timeline = []
    simulate_graph(g, times, transfers, SimulationOptions(prefetch_window=None), timeline=timeline)
    concurrent_end = {i: e for kind, i, _, e in timeline if kind == "comm"}[1]
    assert concurrent_end == pytest.approx(3.0)  # 1 s of work at half the link: 2 s
