"""The cluster catalogue, lookups, user clusters and their files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shardplan.costmodel import (
    CLUSTERS,
    Cluster,
    ClusterConfigError,
    LinkLevel,
    UnknownClusterError,
    compute_time,
    get_cluster,
    known_clusters,
    load_cluster,
    register_cluster,
    tf32_matmuls,
)
from shardplan.ir.errors import ShardplanError


def test_catalogue_has_the_design_clusters() -> None:
    for name in ("h100-sxm", "h200-sxm", "a100-80gb", "b200", "tpu-v5p", "cpu-test"):
        assert name in CLUSTERS
        assert get_cluster(name) is CLUSTERS[name]
        assert CLUSTERS[name].source
    assert set(CLUSTERS) <= set(known_clusters())


def test_catalogue_numbers_match_the_reference_sheet() -> None:
    h100 = get_cluster("h100-sxm")
    assert h100.peak("bf16") == pytest.approx(989.4e12)
    assert h100.peak("f8e4m3") == pytest.approx(1978.9e12)
    assert h100.hbm_bandwidth == pytest.approx(3.35e12)
    assert h100.hbm_capacity == 80 * 10**9
    assert h100.devices_per_node == 8
    assert h100.intra_node.bandwidth == pytest.approx(370e9)
    assert 46e9 <= h100.inter_node.bandwidth <= 49e9
    assert h100.all_to_all_bandwidth == h100.inter_node.bandwidth
    assert h100.compute_efficiency == pytest.approx(0.70)
    assert h100.kernel_floor == pytest.approx(7e-6)
    a100 = get_cluster("a100-80gb")
    assert a100.peak("bf16") == pytest.approx(312e12)
    assert a100.hbm_bandwidth == pytest.approx(2.039e12)
    assert a100.intra_node.bandwidth == pytest.approx(230e9)
    h200 = get_cluster("h200-sxm")
    assert h200.hbm_bandwidth == pytest.approx(4.8e12)
    assert h200.hbm_capacity == 141 * 10**9
    v5p = get_cluster("tpu-v5p")
    assert v5p.peak("bf16") == pytest.approx(459e12)
    assert v5p.hbm_bandwidth == pytest.approx(2.765e12)


def test_catalogue_is_internally_consistent() -> None:
    for cluster in CLUSTERS.values():
        assert cluster.intra_node.bandwidth >= cluster.inter_node.bandwidth
        assert 0 < cluster.compute_efficiency <= 1
        assert 0 < cluster.memory_efficiency <= 1
        assert cluster.peak("bf16") >= cluster.peak("f32")


def test_cpu_test_cluster_has_round_numbers_and_no_floor() -> None:
    cpu = get_cluster("cpu-test")
    assert cpu.devices_per_node == 4
    assert cpu.kernel_floor == 0.0
    assert cpu.compute_efficiency == cpu.memory_efficiency == 1.0
    assert cpu.intra_node == LinkLevel("test-intra", 100e9, 1e-6)
    assert cpu.inter_node == LinkLevel("test-inter", 10e9, 10e-6)


def test_get_cluster_unknown_lists_known_names() -> None:
    with pytest.raises(UnknownClusterError, match=r"unknown cluster 'h900'.*h100-sxm"):
        get_cluster("h900")
    assert issubclass(UnknownClusterError, ShardplanError)


def test_cluster_is_hashable_and_peak_accepts_a_dict() -> None:
    cluster = Cluster(
        name="tiny",
        devices_per_node=2,
        peak_flops={"f32": 1e12, "bf16": 2e12},
        hbm_bandwidth=1e11,
        hbm_capacity=10**9,
        intra_node=LinkLevel("a", 1e10, 1e-6),
        inter_node=LinkLevel("b", 1e9, 1e-5),
        all_to_all_bandwidth=1e9,
    )
    assert cluster.peak_flops == (("bf16", 2e12), ("f32", 1e12))
    assert hash(cluster) == hash(Cluster(**{f: getattr(cluster, f) for f in cluster.__slots__}))
    assert cluster.peak("f8e4m3") == 1e12  # unknown dtype: the slowest listed rate
    assert cluster.nics_per_node == 2


def test_cluster_rejects_bad_efficiency() -> None:
    with pytest.raises(ClusterConfigError, match="compute_efficiency"):
        Cluster(
            name="bad",
            devices_per_node=1,
            peak_flops={"f32": 1.0},
            hbm_bandwidth=1.0,
            hbm_capacity=1,
            intra_node=LinkLevel("a", 1.0, 0.0),
            inter_node=LinkLevel("b", 1.0, 0.0),
            all_to_all_bandwidth=1.0,
            compute_efficiency=1.5,
        )


def test_register_cluster_makes_it_reachable() -> None:
    mine = register_cluster(
        Cluster(
            name="test-registered",
            devices_per_node=2,
            peak_flops={"f32": 1e12},
            hbm_bandwidth=1e11,
            hbm_capacity=10**9,
            intra_node=LinkLevel("a", 1e10, 1e-6),
            inter_node=LinkLevel("b", 1e9, 1e-5),
            all_to_all_bandwidth=1e9,
        )
    )
    assert get_cluster("test-registered") is mine
    with pytest.raises(ClusterConfigError, match="already registered"):
        register_cluster(mine, overwrite=False)


def test_load_cluster_toml_with_base(tmp_path: Path) -> None:
    path = tmp_path / "slow-ib.toml"
    path.write_text(
        'name = "test-slow-ib"\n'
        'base = "h100-sxm"\n'
        "all_to_all_bandwidth = 24e9\n"
        "[inter_node]\n"
        "bandwidth = 24e9\n"
        "latency = 20e-6\n"
    )
    cluster = load_cluster(path)
    assert get_cluster("test-slow-ib") is cluster
    assert cluster.inter_node == LinkLevel("inter_node", 24e9, 20e-6)
    assert cluster.peak("bf16") == pytest.approx(989.4e12)  # inherited


def test_load_cluster_json_full_description(tmp_path: Path) -> None:
    data = {
        "name": "test-json",
        "devices_per_node": 2,
        "peak_flops": {"bf16": 1e14},
        "hbm_bandwidth": 1e12,
        "hbm_capacity": 8 * 10**9,
        "intra_node": {"bandwidth": 5e10, "latency": 2e-6},
        "inter_node": {"bandwidth": 5e9, "latency": 2e-5},
        "all_to_all_bandwidth": 5e9,
    }
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    cluster = load_cluster(path, register=False)
    assert cluster.peak("bf16") == 1e14
    assert cluster.intra_node.bandwidth == 5e10
    with pytest.raises(UnknownClusterError):
        get_cluster("test-json")


def test_load_cluster_reports_unknown_fields_and_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('name = "x"\nbase = "cpu-test"\nflops = 3\n')
    with pytest.raises(ClusterConfigError, match=r"unknown cluster fields \['flops'\]"):
        load_cluster(path)
    with pytest.raises(ClusterConfigError, match="cannot read"):
        load_cluster(tmp_path / "missing.toml")


def test_tf32_matmuls_prices_fp32_math_at_the_tf32_rate() -> None:
    """A100 TF32: fp32 GEMMs/convolutions at 156 TF, not the 19.5 TF CUDA-core rate; the
    other peaks, links and capacity are the cluster's; a cluster without a tf32 peak is
    refused by name."""
    base = get_cluster("a100-80gb")
    tf32 = tf32_matmuls(base)
    assert tf32.name == "a100-80gb+tf32"
    assert tf32.peak("f32") == base.peak("tf32") == 156e12
    assert tf32.peak("f16") == base.peak("f16")
    assert (tf32.hbm_bandwidth, tf32.intra_node) == (base.hbm_bandwidth, base.intra_node)
    flops = 1e12  # a GEMM-sized fp32 kernel: 8x faster than on CUDA cores
    assert compute_time(flops, 0, "f32", tf32) == pytest.approx(
        compute_time(flops, 0, "f32", base) * 19.5 / 156
    )
    with pytest.raises(ClusterConfigError, match=r"cpu-test.*no tf32 peak"):
        tf32_matmuls("cpu-test")
