"""NCCL's protocol latencies for ring collectives inside a node on serving engines (nccl.py)."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.costmodel.collectives import collective_time
from shardplan.costmodel.engine import with_engine
from shardplan.costmodel.nccl import ring_protocol_times, ring_time

BUSBW = 370e9  # h100-sxm ring bus bandwidth (catalogue)


def _mesh(n: int, engine: str, nodes: int = 1) -> sp.Mesh:
    axes = {"dp": nodes, "tp": n} if nodes > 1 else {"tp": n}
    return sp.Mesh(axes, cluster=with_engine("h100-sxm", engine))


def test_a_small_all_reduce_is_ll_and_pays_every_ring_step():
    """8 KB over 8 ranks: LL, 6.6 us base + 2(8-1) x 0.6 us NVLink steps + its bytes."""
    times = ring_protocol_times("all-reduce", 8192, 8, BUSBW)
    assert min(times, key=times.get) == "LL"
    volume = 2 * 7 / 8 * 8192 / (BUSBW / 4)
    assert times["LL"] == pytest.approx(6.6e-6 + 14 * 0.6e-6 + volume)
    assert collective_time("all-reduce", 8192, "tp", _mesh(8, "cuda_graph")) == times["LL"]


def test_a_large_all_reduce_is_simple_and_bandwidth_bound():
    times = ring_protocol_times("all-reduce", 1 << 30, 8, BUSBW)
    assert min(times, key=times.get) == "Simple"
    assert ring_time("all-reduce", 1 << 30, 8, BUSBW) == pytest.approx(
        8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * (1 << 30) / BUSBW
    )


def test_the_latency_grows_with_the_group():
    small = [collective_time("all-reduce", 8192, "tp", _mesh(n, "fused")) for n in (2, 4, 8)]
    assert small == sorted(small)
    assert small[2] - small[1] == pytest.approx(8 * 0.6e-6, rel=0.05)  # 8 more LL steps


def test_eager_clusters_and_inter_node_groups_keep_the_flat_alpha():
    """The training rows and plan digests are priced on eager clusters: unchanged there; a
    group spanning nodes keeps the alpha-beta of collectives.py on every engine."""
    eager = collective_time("all-reduce", 8192, "tp", _mesh(8, "eager"))
    assert eager == pytest.approx(8.4e-6 + 2 * 7 / 8 * 8192 / BUSBW)
    across = [collective_time("all-reduce", 8192, "dp", _mesh(8, e, nodes=2))
              for e in ("eager", "cuda_graph")]  # fmt: skip
    assert across[0] == across[1]


def test_reduce_scatter_and_all_gather_count_the_full_buffer():
    mesh = _mesh(4, "cuda_graph")
    shard = 1 << 20
    rs = collective_time("reduce-scatter", shard, "tp", mesh)  # the result is one shard
    ag = collective_time("all-gather", 4 * shard, "tp", mesh)  # the result is the full buffer
    assert rs == pytest.approx(ag)
    assert rs == ring_time("all-gather", 4 * shard, 4, BUSBW)
