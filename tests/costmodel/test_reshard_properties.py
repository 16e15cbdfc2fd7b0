"""Hypothesis properties of reshard over random meshes, shapes and shardings."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardplan.costmodel import get_cluster, reshard, reshard_time
from shardplan.costmodel.reshard import ReshardPricer
from shardplan.ir.mesh import Mesh
from shardplan.ir.sharding import Sharding
from shardplan.ir.types import TensorType

CPU = get_cluster("cpu-test")
AXES = ("a", "b", "c")


@st.composite
def mesh_and_type(draw: st.DrawFn) -> tuple[Mesh, TensorType]:
    count = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.sampled_from([2, 4]), min_size=count, max_size=count))
    rank = draw(st.integers(1, 3))
    # every dim divisible by the whole mesh (at most 64), so any sharding fits
    shape = tuple(draw(st.sampled_from([64, 128])) for _ in range(rank))
    return Mesh(dict(zip(AXES, sizes, strict=False)), cluster="cpu-test"), TensorType(shape, "bf16")


@st.composite
def sharding_for(draw: st.DrawFn, mesh: Mesh, rank: int) -> Sharding:
    dims: list[list[str]] = [[] for _ in range(rank)]
    partial = []
    for axis in draw(st.permutations(mesh.axis_names)):
        place = draw(st.integers(-2, rank - 1))  # -2 unused, -1 partial, else a dim
        if place == -1:
            partial.append(axis)
        elif place >= 0:
            dims[place].append(axis)
    return Sharding(tuple(tuple(d) for d in dims), frozenset(partial))


@st.composite
def reshard_case(draw: st.DrawFn) -> tuple[Sharding, Sharding, TensorType, Mesh]:
    mesh, type_ = draw(mesh_and_type())
    src = draw(sharding_for(mesh, type_.rank))
    dst = draw(sharding_for(mesh, type_.rank))
    return src, dst, type_, mesh


def is_refinement(src: Sharding, dst: Sharding) -> bool:
    """dst only appends axes to src's dims (local slicing) and keeps the same partial axes."""
    return src.partial == dst.partial and all(
        d[: len(s)] == s for s, d in zip(src.dims, dst.dims, strict=True)
    )


@settings(max_examples=200, deadline=None)
@given(reshard_case())
def test_reshard_cost_is_zero_exactly_for_slicing_refinements(case) -> None:
    src, dst, type_, mesh = case
    cost = reshard_time(src, dst, type_, mesh, CPU)
    if not dst.partial <= src.partial:
        assert cost == math.inf
        return
    assert math.isfinite(cost)
    assert (cost == 0.0) == (src == dst or is_refinement(src, dst))
    assert (reshard(src, dst, type_, mesh, CPU) == ()) == (cost == 0.0)


@settings(max_examples=200, deadline=None)
@given(reshard_case())
def test_reshard_collectives_touch_only_axes_that_change(case) -> None:
    src, dst, type_, mesh = case
    if not dst.partial <= src.partial:
        return
    dropped = src.partial - dst.partial
    for op in reshard(src, dst, type_, mesh, CPU):
        assert 0 < op.bytes <= type_.nbytes
        assert op.time > 0
        axes = set(op.axes)
        if op.kind in ("all-reduce", "reduce-scatter"):
            assert axes <= dropped
        if op.kind == "all-gather":
            assert axes <= src.sharded_axes
        if op.kind == "all-to-all":
            assert axes <= src.sharded_axes & dst.sharded_axes


@settings(max_examples=200, deadline=None)
@given(reshard_case())
def test_reshard_dropped_partial_axes_are_reduced_exactly_once(case) -> None:
    src, dst, type_, mesh = case
    if not dst.partial <= src.partial:
        return
    reduced: list[str] = []
    for op in reshard(src, dst, type_, mesh, CPU):
        if op.kind in ("all-reduce", "reduce-scatter"):
            reduced.extend(op.axes)
    assert sorted(reduced) == sorted(src.partial - dst.partial)


# -- times against the alpha-beta formula, written out by hand ------------------------------------
ONE_NODE = dataclasses.replace(CPU, name="cpu-test-node64", devices_per_node=64)
"""cpu-test with 64 devices per node: every group here is intra-node, alpha 1 us, 100 GB/s."""
ALPHA, BANDWIDTH = 1e-6, 100e9


def alpha_beta(kind: str, nbytes: int, n: int) -> float:
    """Ring formulas (bytes are per-device results; reduce-scatter reads n of them)."""
    ring = (n - 1) / n
    volume = {
        "all-gather": ring * nbytes,
        "reduce-scatter": ring * n * nbytes,
        "all-reduce": 2 * ring * nbytes,
        "all-to-all": ring * nbytes,
        "collective-permute": nbytes,
    }[kind]
    return ALPHA + volume / BANDWIDTH


@settings(max_examples=200, deadline=None)
@given(reshard_case())
def test_reshard_time_is_the_alpha_beta_sum_of_its_collectives(case) -> None:
    """Inside one node every collective costs alpha + its ring volume / bandwidth, and the
    reshard costs the sum; each collective moves at most the whole tensor."""
    src, dst, type_, mesh = case
    if not dst.partial <= src.partial:
        return
    total = 0.0
    for op in reshard(src, dst, type_, mesh, ONE_NODE):
        n = math.prod(mesh.axis_size(a) for a in op.axes)
        assert 0 < op.bytes <= type_.nbytes
        assert type_.nbytes % op.bytes == 0  # an even piece of the tensor
        assert op.time == pytest.approx(alpha_beta(op.kind, op.bytes, n), rel=1e-12)
        total += op.time
    assert reshard_time(src, dst, type_, mesh, ONE_NODE) == pytest.approx(total, rel=1e-12)


MESH_3D = Mesh({"a": 2, "b": 2, "c": 2}, cluster="cpu-test")
F32 = TensorType((64, 128), "f32")  # 32,768 bytes
S = Sharding.of


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        # [64/4, 128/2] -> whole: gather c on dim 1 (8 KiB out of 16x128x4), then a+b on dim 0
        # (32 KiB): 2 alpha + (1/2 * 8192 + 3/4 * 32768) / bw; the other order costs the same
        (S(("a", "b"), "c"), S(None, None), 2 * ALPHA + (0.5 * 8192 + 0.75 * 32768) / BANDWIDTH),
        # pending over all three axes -> replicated: one all-reduce of 8 devices
        (S(None, None, partial="abc"), S(None, None), ALPHA + 2 * 7 / 8 * 32768 / BANDWIDTH),
        # pending over a -> dim 1 split over a: one reduce-scatter, 16 KiB out, 32 KiB in
        (S(None, None, partial="a"), S(None, "a"), ALPHA + 0.5 * 32768 / BANDWIDTH),
        # dim 0 on a -> dim 1 on a: one all-to-all of the 16 KiB local piece
        (S("a", None), S(None, "a"), ALPHA + 0.5 * 16384 / BANDWIDTH),
        # a refinement (slicing more) and the same layout are free
        (S("a", None), S(("a", "b"), "c"), 0.0),
        (S("a", "b", partial="c"), S("a", "b", partial="c"), 0.0),
    ],
)
def test_reshard_time_by_hand_on_a_3d_mesh(src, dst, expected: float) -> None:
    assert reshard_time(src, dst, F32, MESH_3D, ONE_NODE) == pytest.approx(expected, rel=1e-12)


_PRICERS: dict[Mesh, ReshardPricer] = {}


@settings(max_examples=200, deadline=None)
@given(reshard_case(), st.sampled_from([(64,), (128, 64), (64, 128, 64)]))
def test_a_warm_pricer_prices_as_reshard_does(case, other_shape) -> None:
    """One pricer per mesh kept across examples (its caches warm, keyed without the mesh and
    cluster, and shared by tensor types): the same seconds as ``reshard_time`` and the same
    collectives as ``reshard``, also for a second tensor type of the same layouts."""
    src, dst, type_, mesh = case
    price = _PRICERS.setdefault(mesh, ReshardPricer(mesh, CPU))
    other = TensorType(other_shape[: type_.rank] + (64,) * (type_.rank - len(other_shape)), "f32")
    for t in (type_, other):
        assert price(src, dst, t) == reshard_time(src, dst, t, mesh, CPU)
        if dst.partial <= src.partial:
            assert price.collectives(src, dst, t) == reshard(src, dst, t, mesh, CPU)
            assert price(src, dst, t) == sum(c.time for c in reshard(src, dst, t, mesh, CPU))
        else:
            assert price.collectives(src, dst, t) is None
            assert math.isinf(price(src, dst, t))
