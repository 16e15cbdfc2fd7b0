"""Islands over a DCN (Pathways): cluster levels, hierarchical collective prices, what-if."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from shardplan.api.whatif import scale_cluster, whatif
from shardplan.costmodel import (
    CLUSTERS,
    ClusterConfigError,
    IslandLevel,
    LinkLevel,
    axis_links,
    cluster_from_dict,
    collective_time,
    get_cluster,
    group_link,
    load_cluster,
    register_cluster,
)
from shardplan.costmodel.collectives import COLLECTIVE_KINDS
from shardplan.ir import Graph, Mesh, Origin, Role, Sharding, TensorType
from shardplan.solver.mesh_search import format_candidates, mesh_candidates, search_mesh

GB = 1e9
# cpu-test (4 devices/node, 100 GB/s + 1 us inside, 10 GB/s per NIC + 10 us across nodes) with
# islands of 8 devices over a 1 GB/s, 50 us DCN: round numbers for hand-computed prices.
ISLANDS = register_cluster(
    cluster_from_dict(
        {
            "base": "cpu-test",
            "name": "cpu-test-islands",
            "islands": [{"devices": 8, "bandwidth": 1 * GB, "latency": 50e-6}],
        }
    )
)


def test_levels_and_axis_links():
    mesh = Mesh({"dp": 4, "tp": 4}, cluster=ISLANDS.name)
    assert [name for name, _, _ in ISLANDS.levels] == ["intra-node", "inter-node", "inter-island"]
    assert [size for _, size, _ in ISLANDS.levels] == [4, 8, None]
    assert axis_links(mesh, ISLANDS) == {"dp": "inter-island", "tp": "intra-node"}
    # an axis straddling the island boundary keeps part of itself inside one island
    straddle = Mesh({"dp": 2, "x": 16}, cluster=ISLANDS.name)
    assert axis_links(straddle, ISLANDS) == {"dp": "inter-island", "x": "inter-island"}
    link = group_link(("x",), straddle, ISLANDS)
    assert (link.level, link.inner_size, link.inner.level) == ("inter-island", 8, "inter-node")
    # a pipeline axis across islands hands activations over the DCN
    pipe = Mesh({"pp": 2, "dp": 2, "tp": 4}, cluster=ISLANDS.name)
    hop = group_link(("pp",), pipe, ISLANDS)
    assert (hop.p2p_bandwidth, hop.latency) == (1 * GB, 50e-6)
    assert group_link(("dp",), pipe, ISLANDS).level == "inter-node"
    # the two-level cluster is untouched
    assert axis_links(Mesh({"dp": 4, "tp": 4}, cluster="cpu-test"), get_cluster("cpu-test")) == {
        "dp": "inter-node", "tp": "intra-node",
    }  # fmt: skip


def test_hierarchical_prices_by_hand():
    """dp=4 x tp=4 on 4-device nodes and 8-device islands: a dp group has m=2 members per
    island (one per node, so one NIC: 10 GB/s) and k=2 islands."""
    mesh = Mesh({"dp": 4, "tp": 4}, cluster=ISLANDS.name)
    s = 80e6
    inner_rs = 10e-6 + 0.5 * s / 10e9  # RS over 2, result s/2: (m-1)/m * s / bw
    inner_ag = 10e-6 + 0.5 * s / 10e9
    dcn_ar = 50e-6 + 2 * 0.5 * (s / 2) / 1e9
    assert collective_time("all-reduce", s, "dp", mesh) == pytest.approx(
        inner_rs + dcn_ar + inner_ag
    )
    out = s / 4  # all-gather: a shard of s/4 per device, gathered to s
    ag = (50e-6 + 0.5 * (s / 2) / 1e9) + (10e-6 + 0.5 * s / 10e9)
    assert collective_time("all-gather", s, "dp", mesh) == pytest.approx(ag)
    rs = (10e-6 + 0.5 * 2 * (2 * out) / 10e9) + (50e-6 + 0.5 * 2 * out / 1e9)
    assert collective_time("reduce-scatter", out, "dp", mesh) == pytest.approx(rs)
    a2a = (10e-6 + 0.5 * (s / 2) / 10e9) + (50e-6 + 0.5 * s / 1e9)
    assert collective_time("all-to-all", s, "dp", mesh) == pytest.approx(a2a)
    assert collective_time("collective-permute", s, "dp", mesh) == pytest.approx(50e-6 + s / 1e9)
    # only 1/m of the buffer crosses: cheaper than one flat ring over the DCN
    flat = 50e-6 + 2 * 0.75 * s / 1e9
    assert collective_time("all-reduce", s, "dp", mesh) < flat
    # a group inside one island is priced by the two lower levels alone
    inside = Mesh({"dp": 2, "tp": 4}, cluster=ISLANDS.name)
    base = Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")
    for kind in COLLECTIVE_KINDS:
        assert collective_time(kind, s, "dp", inside) == collective_time(kind, s, "dp", base)


@pytest.mark.parametrize("base", ["h100-sxm", "a100-80gb", "cpu-test"])
def test_islands_never_crossed_price_like_the_lower_levels(base):
    """Every group of every mesh that fits one island costs what the island-free cluster says
    (so adding island levels leaves every two-level price unchanged)."""
    huge = cluster_from_dict(
        {
            "base": base,
            "name": f"{base}-one-island",
            "islands": [{"devices": 1 << 20, "bandwidth": 1e6, "latency": 1.0}],
        }
    )
    register_cluster(huge)
    for axes in ({"a": 2, "b": 8}, {"a": 4, "b": 4, "c": 8}, {"a": 16, "b": 3}, {"a": 64}):
        mesh, flat = Mesh(axes, cluster=huge.name), Mesh(axes, cluster=base)
        assert axis_links(mesh, huge) == axis_links(flat, get_cluster(base))
        for r in range(1, len(axes) + 1):
            for group in itertools.combinations(axes, r):
                for kind in COLLECTIVE_KINDS:
                    assert collective_time(kind, 1e7, group, mesh) == collective_time(
                        kind, 1e7, group, flat
                    )


def test_catalogue_multi_island_entries():
    dgx = CLUSTERS["h100-superpod-dcn"]
    h100 = CLUSTERS["h100-sxm"]
    assert dgx.islands == (IslandLevel(256, LinkLevel("dcn-ethernet", 10 * GB, 30e-6)),)
    assert (dgx.intra_node, dgx.inter_node, dgx.peak_flops) == (
        h100.intra_node, h100.inter_node, h100.peak_flops,
    )  # fmt: skip
    v5p = CLUSTERS["tpu-v5p-multislice"]
    assert v5p.islands[0].link.bandwidth == pytest.approx(6.25 * GB)  # 50 Gb/s per chip
    assert v5p.islands[0].devices == 256
    # inside a slice every group runs on ICI, across hosts too
    mesh = Mesh({"dp": 2, "tp": 64}, cluster=v5p.name)
    assert group_link(("tp",), mesh, v5p).ring_bandwidth == v5p.intra_node.bandwidth
    for cluster in (dgx, v5p):
        assert cluster.source
        assert cluster.islands[0].link.bandwidth < cluster.inter_node.bandwidth


def test_bad_island_levels_are_clear_errors():
    with pytest.raises(ClusterConfigError, match="larger multiple"):
        cluster_from_dict({"base": "cpu-test", "islands": [{"devices": 6, "bandwidth": 1e9,
                                                           "latency": 0}]})  # fmt: skip
    with pytest.raises(ClusterConfigError, match="needs 'devices'"):
        cluster_from_dict({"base": "cpu-test", "islands": [{"bandwidth": 1e9, "latency": 0}]})
    with pytest.raises(ClusterConfigError, match="bandwidth > 0"):
        cluster_from_dict({"base": "cpu-test", "islands": [{"devices": 8, "bandwidth": 0,
                                                           "latency": 0}]})  # fmt: skip
    with pytest.raises(ClusterConfigError, match="no island levels"):
        scale_cluster(get_cluster("h100-sxm"), "dcn_bandwidth", 0.5)


def test_scale_dcn_bandwidth_touches_only_the_dcn():
    half = scale_cluster(ISLANDS, "dcn_bandwidth", 0.5)
    assert half.islands[0].link.bandwidth == pytest.approx(0.5 * GB)
    assert (half.intra_node, half.inter_node) == (ISLANDS.intra_node, ISLANDS.inter_node)
    every = scale_cluster(ISLANDS, "link_bandwidth", 2)
    assert every.islands[0].link.bandwidth == pytest.approx(2 * GB)


def one_linear_layer(batch: int, width: int) -> Graph:
    """``h = x @ w``, a sum loss, the weight gradient and an SGD update aliased to ``w``."""
    g = Graph(name="one_linear_layer")
    f32 = lambda *shape: TensorType(shape, "f32")  # noqa: E731

    def op(kind, operands, shape, name, module, **attrs):
        return g.add_op(kind, operands, [f32(*shape)], attrs=attrs, origin=Origin(module=module),
                        names=[name]).result  # fmt: skip

    x = g.add_input("x", f32(batch, width), Role.INPUT, Origin(path="x"))
    w = g.add_input("w", f32(width, width), Role.PARAMETER, Origin(path="layers.0.w"))
    h = op("dot", [x, w], (batch, width), "h", "layers.0")
    loss = op("reduce_sum", [h], (), "loss", "loss", axes=(0, 1))
    grad = op("add", [h, h], (batch, width), "g_h", "loss")
    g_w = op("einsum", [x, grad], (width, width), "g_w", "layers.0", equation="bi,bj->ij")
    new = op("sub", [w, g_w], (width, width), "w_new", "sgd")
    g.set_outputs([loss, new], aliases={1: 1})
    return g


def _dcn_term(kind: str, nbytes: float, n: int, m: int, bandwidth: float) -> float:
    """The bandwidth part of the DCN step of one island-spanning collective (module table)."""
    k = n // m
    return {
        "all-reduce": 2 * (k - 1) / k * nbytes / m,
        "all-gather": (k - 1) / k * nbytes / m,
        "reduce-scatter": (k - 1) * nbytes,
    }[kind] / bandwidth


def test_whatif_halving_dcn_bandwidth_follows_the_closed_form():
    """One data-parallel layer over 2 islands: its gradient reduction (reduce-scatter, update,
    all-gather back, or an all-reduce) is the step's last communication and hides behind
    nothing, so halving the DCN lengthens the step by exactly the DCN bandwidth terms of the
    plan's island-spanning collectives (t(d/2) - t(d) = V/d)."""
    graph = one_linear_layer(batch=256, width=2048)
    mesh = Mesh({"dp": 16}, cluster=ISLANDS.name)
    dp, partial = Sharding.of("dp", None), Sharding.of(None, None, partial=["dp"])
    pins = {"x": dp, "g_h": dp, "g_w": partial, "w": Sharding.replicated(2)}
    pins["w_new"] = Sharding.replicated(2)  # data parallel: the gradient is reduced over dp
    result = whatif(graph, mesh=mesh, vary={"dcn_bandwidth": [1, 0.5]}, strategy=pins)
    full, half = result.rows
    assert full.status == half.status == "ok"
    assert not half.plan_changed

    from shardplan.solver.planner import plan_graph

    plan = plan_graph(graph, mesh, pins=pins)
    expected = 0.0
    for reshard in plan.reshards:
        for c in reshard.collectives:
            link = group_link(c.axes, mesh, ISLANDS)
            if link.level == "inter-island":
                n = mesh.group_size(c.axes)
                expected += _dcn_term(c.kind, c.bytes, n, link.inner_size, 1 * GB)
    kinds = sorted({c.kind for c in plan.collectives()})
    assert kinds in (["all-gather", "all-reduce", "reduce-scatter"], ["all-reduce"])
    assert expected > 1e-3  # the gradient (16 MB) crosses the DCN
    assert half.step_time - full.step_time == pytest.approx(expected, rel=1e-6)


def test_mesh_candidates_add_an_island_split_of_dp():
    flat = mesh_candidates(128, 8)
    shapes = mesh_candidates(128, 8, 64)
    assert [s for s in shapes if "dcn" not in s] == flat  # the two-level search is unchanged
    split = [s for s in shapes if "dcn" in s]
    assert {"pp": 1, "dcn": 2, "dp": 8, "tp": 8} in split
    assert {"pp": 1, "dcn": 2, "dp": 32, "tp": 2} in split
    for s in split:  # dp x tp (x pp's share) fills exactly one island; pp never covers them all
        assert s["pp"] == 1
        assert s["dp"] * s["tp"] == 64
    assert mesh_candidates(64, 8, 64) == mesh_candidates(64, 8)  # one island: nothing to split


def test_mesh_search_on_islands_lists_the_axes_crossing_them():
    graph = one_linear_layer(batch=256, width=512)
    plan = search_mesh(graph, 16, ISLANDS.name, max_stages=1, time_limit=10)
    by_shape = {tuple(c.mesh.items()): c for c in plan.candidates}
    assert by_shape[(("pp", 1), ("dcn", 2), ("dp", 4), ("tp", 2))].across_islands == ("dcn",)
    assert by_shape[(("pp", 1), ("dp", 8), ("tp", 2))].across_islands == ("dp",)
    assert by_shape[(("pp", 1), ("dp", 16), ("tp", 1))].across_islands == ("dp",)
    assert plan.step_time == min(c.step_time for c in plan.candidates if c.step_time)
    assert "across islands: dcn" in format_candidates(plan.candidates)


def test_cluster_file_with_islands(tmp_path):
    path = tmp_path / "two-pods.toml"
    path.write_text(
        'name = "h100-two-pods"\nbase = "h100-sxm"\n'
        'islands = [{ devices = 64, bandwidth = 5e9, latency = 40e-6, name = "wan" }]\n'
    )
    cluster = load_cluster(path, register=False)
    assert cluster.islands == (IslandLevel(64, LinkLevel("wan", 5e9, 40e-6)),)
    assert cluster.intra_node == get_cluster("h100-sxm").intra_node
    # a level left without its link inherits the base's: only the island size changes
    resized = cluster_from_dict({"base": "h100-superpod-dcn", "islands": [{"devices": 512}]})
    assert resized.islands[0].link == get_cluster("h100-superpod-dcn").islands[0].link


def test_three_island_levels_price_recursively():
    """Pods of 8 devices (1 GB/s, 50 us) inside sites of 16 (0.5 GB/s, 100 us): a dp group of 8
    (one member per node) runs RS/AG over 2 pods inside a site, each itself RS/AG over 2 nodes,
    and all-reduces across the 2 sites. By hand, for S bytes:
      RS over the site (result S/4) = [10 us + S/2 / 10 GB/s] + [50 us + S/4 / 1 GB/s]
      AR across sites on S/4       = 100 us + (S/4) / 0.5 GB/s
      AG over the site (result S)  = [50 us + S/4 / 1 GB/s] + [10 us + S/2 / 10 GB/s]
    """
    sites = cluster_from_dict(
        {
            "base": "cpu-test",
            "name": "cpu-test-sites",
            "islands": [
                {"devices": 8, "bandwidth": 1 * GB, "latency": 50e-6},
                {"devices": 16, "bandwidth": 0.5 * GB, "latency": 100e-6},
            ],
        }
    )
    register_cluster(sites)
    mesh = Mesh({"dp": 8, "tp": 4}, cluster=sites.name)
    assert [name for name, _, _ in sites.levels][2:] == ["inter-island", "inter-island-2"]
    assert axis_links(mesh, sites) == {"dp": "inter-island-2", "tp": "intra-node"}
    s = 80e6
    expected = 220e-6 + s / 10e9 + s / 1e9
    assert collective_time("all-reduce", s, "dp", mesh) == pytest.approx(expected)
    link = group_link(("dp",), mesh, sites)
    assert (link.inner_size, link.inner.inner_size, link.inner.inner.level) == (4, 2, "inter-node")
    # halving only the outer DCN adds exactly its bandwidth term, (S/4) / 0.5 GB/s
    outer_half = replace(sites, name="cpu-test-sites-slow", islands=(
        sites.islands[0], IslandLevel(16, LinkLevel("dcn", 0.25 * GB, 100e-6)),
    ))  # fmt: skip
    register_cluster(outer_half)
    slow = collective_time("all-reduce", s, "dp", Mesh(mesh.axes, cluster=outer_half.name))
    assert slow - expected == pytest.approx((s / 4) / (0.5 * GB))
