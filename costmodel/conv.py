"""Convolutions priced as implicit GEMMs (cuDNN's and CUTLASS's forward, data- and
weight-gradient kernels).

A convolution of ``N`` images of ``P`` output pixels, ``G`` groups of ``C`` input and ``K``
output channels and an ``R x S`` kernel is a GEMM of ``M = N * P``, ``N_gemm = K``,
``K_gemm = C * R * S`` per group (NVIDIA's Deep Learning Performance Guide, "Convolution
Algorithms": the implicit-GEMM view), so it runs at GEMM efficiency
(``Cluster.compute_efficiency``) times the fraction of the kernel's tiles that hold data:

* output channels fill threadblock tiles ``TILE_N`` wide and the reduction runs in
  ``TILE_K`` steps (CUTLASS's Ampere/Hopper conv2d kernels: 64/128-wide N tiles, K steps of
  32 or 64 half-precision values); a 147-deep reduction (the 7x7 stem on 3 channels) fills 147
  of 160 slots;
* Tensor Cores take channels in multiples of 8 (the guide's "channels multiple of 8" rule):
  cuDNN pads a 3-channel input to 8, so the stem does 8/3 of its useful work;
* a grouped convolution packs several groups into one tile along N (CUTLASS's
  multiple-groups-per-CTA mode), so the N tile holds ``G * K`` channels;
* a depthwise convolution (one input channel per group) is not a GEMM: cuDNN runs it as a
  direct, memory-bound kernel, priced by its bytes alone (work factor 0, the roofline's memory
  term decides).

``conv_work_factor`` is the multiplier on the op's even per-device FLOPs that turns the
roofline's GEMM efficiency into this one (``attention_work_factor``'s convention). Pooling and
resampling ops keep their element count as FLOPs: they are memory-bound, the roofline's bytes
decide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..ir import Mesh, Op, Sharding, TensorType
from ..ir.conv import halos
from ..ir.halo import halo_rows as halo_rows  # re-exported: the runtimes size halos with it
from ..ir.window import POOL_KINDS, window_halos
from .cluster import Cluster, get_cluster
from .collectives import Collective, collective_time

CONV_KINDS = ("convolution", "convolution_backward")
HALO_KINDS = (*CONV_KINDS, *POOL_KINDS)
"""Ops whose spatial splits exchange halos (``halo_collectives``)."""
TILE_N = 64
"""Output channels per threadblock tile (the narrowest CUTLASS/cuDNN implicit-GEMM tile)."""
TILE_K = 32
"""Reduction step of a tile, in elements (one 64-byte half-precision K step)."""
TENSOR_CORE_CHANNELS = 8
"""Tensor Core kernels read input channels in groups of this many (padded)."""


def _ceil(x: int, step: int) -> int:
    return step * math.ceil(x / step)


def implicit_gemm(op: Op) -> tuple[int, int, int, int, int]:
    """``(M, N, K, groups, channels per group)`` of a convolution's forward implicit GEMM
    (the backward's two GEMMs are its transposes, with the same tiles along channels)."""
    types = [v.type for v in op.operands]
    if op.kind == "convolution":
        lhs, rhs, out = types[0], types[1], op.results[0].type
        lhs_dims = tuple(op.attrs.get("lhs_dims", range(lhs.rank)))  # type: ignore[call-overload]
        rhs_dims = tuple(op.attrs.get("rhs_dims", range(rhs.rank)))  # type: ignore[call-overload]
        out_dims = tuple(op.attrs.get("out_dims", range(out.rank)))  # type: ignore[call-overload]
    else:  # convolution_backward(grad_out, lhs, rhs): torch layouts
        out, lhs, rhs = types[0], types[1], types[2]
        lhs_dims = out_dims = tuple(range(lhs.rank))
        rank = rhs.rank
        rhs_dims = (1, 0, *range(2, rank)) if op.attrs.get("transposed") else tuple(range(rank))
    groups = int(op.attrs.get("feature_group_count", 1))  # type: ignore[call-overload]
    return _gemm(lhs, rhs, out, (lhs_dims, rhs_dims, out_dims), groups)


def _gemm(lhs: TensorType, rhs: TensorType, out: TensorType, dims: tuple, groups: int) -> tuple:
    lhs_dims, rhs_dims, out_dims = dims
    taps = math.prod(rhs.shape[d] for d in rhs_dims[2:])
    channels = lhs.shape[lhs_dims[1]] // max(groups, 1)
    out_features = out.shape[out_dims[1]]
    m = out.numel // max(out_features, 1)
    return m, out_features // max(groups, 1), channels * taps, groups, channels


def tile_utilisation(out_channels: int, in_channels: int, taps: int, groups: int = 1) -> float:
    """Fraction of an implicit-GEMM kernel's tile slots holding data (per-group channel
    counts); 0 for a depthwise convolution (no GEMM)."""
    if groups > 1 and in_channels == 1:
        return 0.0
    packed_n = groups * out_channels
    k = in_channels * taps
    padded = _ceil(in_channels, TENSOR_CORE_CHANNELS) * taps
    return (packed_n / _ceil(packed_n, TILE_N)) * (k / _ceil(padded, TILE_K))


def conv_work_factor(op: Op, cluster: Cluster | str | None = None) -> float:
    """Multiplier on a convolution's FLOPs for a roofline at GEMM efficiency (1 for other
    ops; 0 for a depthwise convolution, which its bytes price): the tile quantisation, and
    the cluster's ``conv_efficiency`` against its ``compute_efficiency`` where calibrated."""
    if op.kind not in CONV_KINDS:
        return 1.0
    _, n, k, groups, channels = implicit_gemm(op)
    used = tile_utilisation(n, channels, k // max(channels, 1), groups)
    if used == 0:
        return 0.0
    kernel = 1.0
    if cluster is not None:
        c = get_cluster(cluster)
        kernel = c.compute_efficiency / (c.conv_efficiency or c.compute_efficiency)
    return kernel / used


def layout_bytes(
    op: Op, operands: Sequence[Sharding], results: Sequence[Sharding], mesh: Mesh
) -> list[int]:
    """Local bytes of each activation a tensor-core convolution transposes between NCHW and
    NHWC (``Cluster.nchw_convolutions``), one entry per transpose, as cuDNN is called: the
    forward converts its input and its result; a backward's data-gradient call converts the
    output gradient and the input gradient, its weight-gradient call the output gradient and
    the input (each call its own). Weights are small and left out; a depthwise convolution
    (a direct NCHW kernel, no GEMM) transposes nothing."""
    if op.kind not in CONV_KINDS or conv_work_factor(op) == 0 or not operands:
        return []

    def local(value_type: TensorType, sharding: Sharding) -> int:
        return value_type.nbytes // sharding.shard_count(mesh)

    if op.kind == "convolution":
        return [local(op.operands[0].type, operands[0]), local(op.results[0].type, results[0])]
    mask = tuple(op.attrs.get("output_mask", (True, True, True)))  # type: ignore[call-overload]
    grad, x = local(op.operands[0].type, operands[0]), local(op.operands[1].type, operands[1])
    found = []
    if mask[0] and op.results:  # the input gradient is the first result
        found += [grad, local(op.results[0].type, results[0])]
    if len(mask) > 1 and mask[1]:
        found += [grad, x]
    return found


def layout_time(
    op: Op,
    operands: Sequence[Sharding],
    results: Sequence[Sharding],
    mesh: Mesh,
    cluster: Cluster | str,
) -> float:
    """Seconds of ``layout_bytes``'s transposes on a ``nchw_convolutions`` cluster (0 on
    others): each reads and writes its tensor once at HBM bandwidth, one kernel apiece."""
    if op.kind not in CONV_KINDS:
        return 0.0
    c = get_cluster(cluster)
    if not c.nchw_convolutions:
        return 0.0
    bandwidth = c.hbm_bandwidth * c.memory_efficiency
    return sum(
        max(2 * b / bandwidth, c.kernel_floor) for b in layout_bytes(op, operands, results, mesh)
    )


def halo_collectives(
    op: Op, operands: Sequence[Sharding], mesh: Mesh, saved_input: bool = False
) -> list[Collective]:
    """The halo exchanges of a convolution or a pooling window (``ir.window``) split along its
    spatial rows (``ir.halo``): per split spatial dim of the input, one collective-permute
    per direction of the rows the window reaches into the neighbouring shards (``lo`` rows
    to the next device, ``hi`` to the previous one, along the splitting axes; XLA's SPMD
    partitioner and ``frontend/torch/halo.py`` both move the two blocks separately). A torch
    backward exchanges the input's rows again for the weight gradient (as XLA's
    weight-gradient convolution does; not with ``saved_input``: ``plan.apply``'s autograd
    keeps the forward's extended slab) and, when it computes the input gradient, sends that
    gradient's halo rows back to their owners."""
    if op.kind not in HALO_KINDS or not operands:
        return []
    backward = op.kind == "convolution_backward"
    lhs, sharding = op.operands[int(backward)].type, operands[int(backward)]
    ins, outs = [v.type for v in op.operands], [v.type for v in op.results]
    split = window_halos if op.kind in POOL_KINDS else halos
    found: list[Collective] = []
    for dim, halo in split(op.kind, ins, outs, op.attrs):
        axes = sharding.dims[dim] if dim < len(sharding.dims) else ()
        if not axes:
            continue
        local_rows = max(lhs.shape[dim] // mesh.group_size(axes), 1)
        row_bytes = lhs.nbytes // sharding.shard_count(mesh) // local_rows
        for rows in (halo.lo, halo.hi):
            if rows > 0:
                found.append(Collective("collective-permute", tuple(axes), rows * row_bytes))
    if not backward:
        return found
    mask = tuple(op.attrs.get("output_mask", (True, True, True)))  # type: ignore[call-overload]
    return found * ((not saved_input) + bool(mask[0]))


def halo_time(op: Op, operands: Sequence[Sharding], mesh: Mesh, cluster: Cluster | str) -> float:
    """Seconds of ``halo_collectives``. Exposed: the kernel waits for its halo."""
    return sum(
        collective_time(c.kind, c.bytes, c.axes, mesh, cluster)
        for c in halo_collectives(op, operands, mesh)
    )
