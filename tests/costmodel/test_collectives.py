"""Hand-computed alpha-beta times on the cpu-test cluster.

cpu-test: 4 devices per node; intra-node alpha 1 us, busbw 100 GB/s; inter-node alpha 10 us,
10 GB/s per NIC (4 NICs per node); all-to-all across nodes 10 GB/s per device.
"""

from __future__ import annotations

import pytest
from shardplan.costmodel import (
    Collective,
    axis_links,
    collective_time,
    get_cluster,
    group_link,
    make_collective,
)
from shardplan.ir.errors import ShardingError
from shardplan.ir.mesh import Mesh

MB = 1_000_000  # per-device result bytes used in every case below
CPU = get_cluster("cpu-test")

# (kind, expected seconds) for n = 4 inside one node: alpha 1e-6, bw 1e11.
INTRA_4 = [
    ("all-gather", 1e-6 + 0.75 * MB / 1e11),  # (n-1)/n * out
    ("reduce-scatter", 1e-6 + 0.75 * 4 * MB / 1e11),  # (n-1)/n * (n * out)
    ("all-reduce", 1e-6 + 2 * 0.75 * MB / 1e11),  # 2(n-1)/n * out
    ("all-to-all", 1e-6 + 0.75 * MB / 1e11),
    ("collective-permute", 1e-6 + MB / 1e11),
]


@pytest.mark.parametrize(("kind", "expected"), INTRA_4)
def test_collective_time_one_axis_intra_node(kind: str, expected: float) -> None:
    mesh = Mesh({"x": 4}, cluster="cpu-test")
    assert collective_time(kind, MB, ("x",), mesh, CPU) == pytest.approx(expected, rel=1e-12)


# {"x": 8} on 4-device nodes: x spans 2 nodes with 4 members in each, so ring collectives run
# 4 rings on 4 NICs: busbw = min(4 * 10 GB/s, 100 GB/s) = 40 GB/s; alpha = 10 us. All-to-all
# and permute get one NIC (10 GB/s); an all-to-all sends its 3 same-node messages over NVLink
# (3/8 * MB / 100 GB/s) while the 4 remote ones share the NIC (4/8 * MB / 10 GB/s, slower).
SPAN_8 = [
    ("all-gather", 10e-6 + 7 / 8 * MB / 4e10),
    ("reduce-scatter", 10e-6 + 7 / 8 * 8 * MB / 4e10),
    ("all-reduce", 10e-6 + 2 * 7 / 8 * MB / 4e10),
    ("all-to-all", 10e-6 + 4 / 8 * MB / 1e10),
    ("collective-permute", 10e-6 + MB / 1e10),
]


@pytest.mark.parametrize(("kind", "expected"), SPAN_8)
def test_collective_time_one_axis_spanning_nodes(kind: str, expected: float) -> None:
    mesh = Mesh({"x": 8}, cluster="cpu-test")
    assert collective_time(kind, MB, "x", mesh, CPU) == pytest.approx(expected, rel=1e-12)


def test_collective_time_literal_values() -> None:
    """The same formulas, written out as plain numbers once."""
    mesh = Mesh({"x": 8}, cluster="cpu-test")
    assert collective_time("all-gather", MB, "x", mesh, CPU) == pytest.approx(31.875e-6)
    assert collective_time("reduce-scatter", MB, "x", mesh, CPU) == pytest.approx(185e-6)
    assert collective_time("all-reduce", MB, "x", mesh, CPU) == pytest.approx(53.75e-6)
    assert collective_time("all-to-all", MB, "x", mesh, CPU) == pytest.approx(60e-6)
    assert collective_time("collective-permute", MB, "x", mesh, CPU) == pytest.approx(110e-6)


# {"dp": 4, "tp": 4}: tp fills the node (intra), dp crosses nodes with one member per node,
# so a dp ring gets one NIC: 10 GB/s.
DP_4 = [
    ("all-gather", 10e-6 + 0.75 * MB / 1e10),
    ("reduce-scatter", 10e-6 + 0.75 * 4 * MB / 1e10),
    ("all-reduce", 10e-6 + 1.5 * MB / 1e10),
    ("all-to-all", 10e-6 + 0.75 * MB / 1e10),
    ("collective-permute", 10e-6 + MB / 1e10),
]
# Over ("dp", "tp"): n = 16 with 4 members per node -> ring busbw 40 GB/s, a2a 10 GB/s for
# the 12 messages to other nodes (the 3 same-node ones ride NVLink meanwhile).
DP_TP_16 = [
    ("all-gather", 10e-6 + 15 / 16 * MB / 4e10),
    ("reduce-scatter", 10e-6 + 15 / 16 * 16 * MB / 4e10),
    ("all-reduce", 10e-6 + 2 * 15 / 16 * MB / 4e10),
    ("all-to-all", 10e-6 + 12 / 16 * MB / 1e10),
    ("collective-permute", 10e-6 + MB / 1e10),
]


@pytest.mark.parametrize(("kind", "expected"), INTRA_4)
def test_collective_time_2d_inner_axis_is_intra_node(kind: str, expected: float) -> None:
    mesh = Mesh({"dp": 4, "tp": 4}, cluster="cpu-test")
    assert collective_time(kind, MB, ("tp",), mesh, CPU) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("kind", "expected"), DP_4)
def test_collective_time_2d_outer_axis_is_inter_node(kind: str, expected: float) -> None:
    mesh = Mesh({"dp": 4, "tp": 4}, cluster="cpu-test")
    assert collective_time(kind, MB, ("dp",), mesh, CPU) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("kind", "expected"), DP_TP_16)
def test_collective_time_2d_axis_group_uses_slowest_link(kind: str, expected: float) -> None:
    mesh = Mesh({"dp": 4, "tp": 4}, cluster="cpu-test")
    got = collective_time(kind, MB, ("dp", "tp"), mesh, CPU)
    assert got == pytest.approx(expected, rel=1e-12)
    assert collective_time(kind, MB, ("tp", "dp"), mesh, CPU) == got  # order is irrelevant


def test_collective_time_2d_mesh_inside_one_node() -> None:
    mesh = Mesh({"x": 2, "y": 2}, cluster="cpu-test")
    assert axis_links(mesh, CPU) == {"x": "intra-node", "y": "intra-node"}
    # n = 4, alpha 1 us, 100 GB/s
    assert collective_time("all-reduce", MB, ("x", "y"), mesh, CPU) == pytest.approx(16e-6)
    assert collective_time("all-gather", MB, "y", mesh, CPU) == pytest.approx(1e-6 + 5e-6)


def test_collective_time_single_device_group_and_empty_buffer_are_free() -> None:
    mesh = Mesh({"dp": 1, "tp": 4}, cluster="cpu-test")
    assert collective_time("all-reduce", MB, "dp", mesh, CPU) == 0.0
    assert collective_time("all-gather", 0, "tp", mesh, CPU) == 0.0


def test_collective_time_all_reduce_is_twice_all_gather_volume() -> None:
    mesh = Mesh({"x": 4}, cluster="cpu-test")
    ag = collective_time("all-gather", MB, "x", mesh, CPU) - 1e-6
    ar = collective_time("all-reduce", MB, "x", mesh, CPU) - 1e-6
    assert ar == pytest.approx(2 * ag)


def test_collective_time_uses_mesh_cluster_by_default() -> None:
    mesh = Mesh({"x": 4}, cluster="cpu-test")
    assert collective_time("all-gather", MB, "x", mesh) == pytest.approx(8.5e-6)


def test_collective_time_rejects_unknown_kind_and_axis() -> None:
    mesh = Mesh({"x": 4}, cluster="cpu-test")
    with pytest.raises(ValueError, match="unknown collective kind"):
        collective_time("broadcast", MB, "x", mesh, CPU)
    with pytest.raises(ShardingError, match="unknown mesh axis 'y'"):
        collective_time("all-gather", MB, "y", mesh, CPU)


def test_make_collective_records_kind_axes_bytes_and_time() -> None:
    mesh = Mesh({"dp": 4, "tp": 4}, cluster="cpu-test")
    op = make_collective("all-reduce", MB, ("tp", "dp"), mesh, CPU)
    assert op == Collective("all-reduce", ("dp", "tp"), MB, 10e-6 + 2 * 15 / 16 * MB / 4e10)


def test_axis_links_packs_innermost_axes_into_a_node() -> None:
    assert axis_links(Mesh({"dp": 4, "tp": 4}, cluster="cpu-test"), CPU) == {
        "dp": "inter-node",
        "tp": "intra-node",
    }
    assert axis_links(Mesh({"x": 8}, cluster="cpu-test"), CPU) == {"x": "inter-node"}
    assert axis_links(Mesh({"a": 2, "b": 2, "c": 2}, cluster="cpu-test"), CPU) == {
        "a": "inter-node",
        "b": "intra-node",
        "c": "intra-node",
    }


def test_group_link_aggregates_nics_up_to_the_intra_node_bandwidth() -> None:
    h100 = get_cluster("h100-sxm")
    mesh = Mesh({"dp": 8, "tp": 8}, cluster="cpu-test")
    assert group_link(("dp",), mesh, h100).ring_bandwidth == pytest.approx(48e9)
    # all 8 GPUs of each node in the ring: 8 x 48 = 384 GB/s, capped by NVSwitch busbw 370
    assert group_link(("dp", "tp"), mesh, h100).ring_bandwidth == pytest.approx(370e9)
    assert group_link(("dp", "tp"), mesh, h100).p2p_bandwidth == pytest.approx(48e9)
    assert group_link(("tp",), mesh, h100).level == "intra-node"
