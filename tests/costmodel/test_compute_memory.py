"""Roofline compute time and per-device value bytes."""

from __future__ import annotations

import pytest
from shardplan.costmodel import compute_time, get_cluster, total_value_bytes, value_bytes
from shardplan.ir.mesh import Mesh
from shardplan.ir.sharding import Sharding
from shardplan.ir.types import TensorType


def test_compute_time_compute_bound_on_cpu_test() -> None:
    # f32 peak 1 TFLOP/s, efficiency 1: 2e12 FLOPs take 2 s; 1e9 bytes at 100 GB/s take 10 ms
    assert compute_time(2e12, 1e9, "f32", "cpu-test") == pytest.approx(2.0)
    assert compute_time(2e12, 1e9, "bf16", "cpu-test") == pytest.approx(1.0)


def test_compute_time_memory_bound_on_cpu_test() -> None:
    assert compute_time(1e6, 3e11, "f32", get_cluster("cpu-test")) == pytest.approx(3.0)


def test_compute_time_empty_kernel_is_free_and_floor_applies_otherwise() -> None:
    assert compute_time(0, 0, "bf16", "h100-sxm") == 0.0
    assert compute_time(1, 0, "bf16", "h100-sxm") == pytest.approx(7e-6)
    assert compute_time(0, 0, "f32", "cpu-test") == 0.0
    assert compute_time(1, 0, "f32", "cpu-test") == pytest.approx(1e-12)  # no floor


def test_compute_time_h100_uses_efficiency_factors() -> None:
    h100 = get_cluster("h100-sxm")
    flops = 989.4e12  # one peak-second of work
    assert compute_time(flops, 0, "bf16", h100) == pytest.approx(1 / 0.70)
    assert compute_time(0, 3.35e12, "bf16", h100) == pytest.approx(1 / 0.80)
    # a 4096^3 bf16 matmul: 2*4096^3 FLOPs, 3*4096^2*2 bytes; ridge 295 FLOP/B -> compute bound
    n = 4096
    t = compute_time(2 * n**3, 6 * n * n, "bf16", h100)
    assert t == pytest.approx(2 * n**3 / (989.4e12 * 0.70))


def test_value_bytes_divides_by_shard_count_not_partial_axes() -> None:
    mesh = Mesh({"dp": 4, "tp": 4}, cluster="cpu-test")
    t = TensorType((64, 128), "bf16")  # 16,384 bytes
    assert value_bytes(t, Sharding.of(None, None), mesh) == 16384
    assert value_bytes(t, Sharding.of("dp", "tp"), mesh) == 1024
    assert value_bytes(t, Sharding.of(("dp", "tp"), None), mesh) == 1024
    assert value_bytes(t, Sharding.of(None, "tp", partial=["dp"]), mesh) == 4096
    pairs = [(t, Sharding.of("dp", None)), (t, Sharding.of(None, None))]
    assert total_value_bytes(pairs, mesh) == 4096 + 16384
