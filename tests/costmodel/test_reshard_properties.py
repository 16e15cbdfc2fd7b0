"""Hypothesis properties of reshard over random meshes, shapes and shardings."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from shardplan.costmodel import get_cluster, reshard, reshard_time
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
    return Mesh(dict(zip(AXES, sizes, strict=False))), TensorType(shape, "bf16")


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


@settings(max_examples=200, deadline=None)
@given(reshard_case())
def test_reshard_is_deterministic_and_cached(case) -> None:
    src, dst, type_, mesh = case
    first = reshard_time(src, dst, type_, mesh, CPU)
    again = reshard_time(src, dst, type_, Mesh(mesh.axes), "cpu-test")
    assert first == again
