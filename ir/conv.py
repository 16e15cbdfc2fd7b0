"""Sharding rules of convolutions (XLA ``ConvGeneralDilated``) and pooling / resampling.

``convolution(lhs, rhs) -> out`` follows XLA: ``attrs`` name the roles of the dims,
``lhs_dims=(batch, feature, *spatial)``, ``rhs_dims=(out_feature, in_feature, *spatial)``,
``out_dims=(batch, feature, *spatial)`` (indices into each tensor; torch NCHW is
``(0, 1, 2, 3)`` for all three, Flax NHWC/HWIO is ``(0, 3, 1, 2)``, ``(3, 2, 0, 1)``,
``(0, 3, 1, 2)``), plus ``strides``, ``padding`` (``(lo, hi)`` per spatial dim),
``lhs_dilation``, ``rhs_dilation``, ``feature_group_count``, ``batch_group_count``. No bias: a
bias is a broadcast ``add`` after it. The factors:

* ``batch`` (lhs batch -> out batch) passes through;
* ``out feature`` (rhs out_feature -> out feature) passes through (a column split);
* ``in feature`` (lhs feature, rhs in_feature) is a reduction: split, the result is partial;
* grouped convolutions (``feature_group_count = G > 1``, depthwise when every group has one
  channel) get a *group* factor, major in the lhs feature, rhs out-feature and out feature dims,
  that passes through: each device runs whole groups. ``batch_group_count = B > 1`` (XLA's weight
  gradient of a grouped convolution) is the mirror image: the group factor is major in the lhs
  batch dim and the out feature dim, and the per-group batch is the out batch;
* kernel spatial dims need replication. An out spatial dim whose input is exactly ``stride``
  times as long (a same-padded convolution, no lhs dilation: ``ir.halo``'s forward form)
  shares its factor with the lhs dim (``(rows, stride)``, the stride part whole): split, each
  device holds a slab of input and output rows and needs a *halo* of ``(kernel - 1) *
  dilation`` input rows from its neighbours (GSPMD's windowed split;
  ``costmodel.conv.halo_collectives`` prices the collective-permutes). XLA's weight gradient
  (``ir.halo``'s window form: the rhs is the output gradient, as long as the input over the
  rhs dilation) shares the rhs rows with the lhs rows instead, and they are summed over (a
  split leaves the kernel-sized result partial). Otherwise the lhs spatial dim needs
  replication and the out spatial dim is an output-only factor: a device may compute a slab
  of output rows from the whole input.
  The group factor is read off the sizes, so a dim that holds one group's features
  (torch's transposed weight ``[C_in, C_out / G, *k]``) gets just the per-group factor.

``convolution_backward(grad_out, lhs, rhs) -> (grad_lhs?, grad_rhs?, grad_bias?)`` (torch's
fused kernel, ``attrs["output_mask"]`` says which results exist, ``attrs["transposed"]`` which
rhs dim is the out feature): the forward's factors, with the batch *summed* into the weight and
bias gradients (a batch split leaves them partial: data parallelism's gradient all-reduce) and
the out feature summed into the input gradient (a column split leaves it partial). A halo
split of the rows passes through the input gradient and is summed into the weight and bias
gradients (each slab's share); other spatial dims need replication here.

FLOPs count multiply-adds that touch data (2 per MAC): a strided or dilated window skips
nothing, a transposed convolution (``lhs_dilation > 1``) skips the inserted zeros, as cuDNN's
data-gradient kernels do. The backward counts one forward per gradient it computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from .errors import IRVerifyError
from .halo import Halo, halo_split
from .registry import register_rule
from .rule_helpers import Attrs, Types, _letter_stream, _make, replicated_rule
from .rules import ShardingRule
from .types import TensorType


def _dims(attrs: Attrs, key: str, rank: int) -> tuple[int, ...]:
    dims = tuple(int(d) for d in attrs.get(key, range(rank)))  # type: ignore[call-overload]
    if sorted(dims) != list(range(rank)):
        raise IRVerifyError(
            f"convolution {key}={dims} must name each of the {rank} dims once "
            "(batch/out_feature, feature/in_feature, then the spatial dims)"
        )
    return dims


class _Factors:
    """Factor letters handed out with their sizes; size-1 factors are left out (a dim made of
    nothing but them is an unmapped size-1 dim)."""

    def __init__(self) -> None:
        self.letters: Iterator[str] = _letter_stream()
        self.sizes: dict[str, int] = {}

    def new(self, size: int) -> str:
        f = next(self.letters)
        self.sizes[f] = size
        return f

    def dim(self, *factors: str) -> tuple[str, ...]:
        return tuple(f for f in factors if self.sizes[f] != 1)


def _groups(attrs: Attrs) -> tuple[int, int]:
    g = int(attrs.get("feature_group_count", 1))  # type: ignore[call-overload]
    b = int(attrs.get("batch_group_count", 1))  # type: ignore[call-overload]
    if g < 1 or b < 1:
        raise IRVerifyError(f"convolution group counts must be >= 1, got {g} and {b}")
    return g, b


def conv_factors(
    lhs: TensorType, rhs: TensorType, out: TensorType, attrs: Attrs, window: bool = False
) -> tuple:
    """Per-dim factors of (lhs, rhs, out), the factor sizes, the spatial factors (the whole
    ones, the split one, whether it splits with a halo) and the out-feature and batch factor
    dims. ``window``: the halo's window form may be taken (``ir.halo``)."""
    ld, rd, od = (_dims(attrs, k, t.rank) for k, t in zip(
        ("lhs_dims", "rhs_dims", "out_dims"), (lhs, rhs, out), strict=True))  # fmt: skip
    groups, batch_groups = _groups(attrs)
    n_out, feat_out = out.shape[od[0]], out.shape[od[1]]
    feat_in = lhs.shape[ld[1]]
    g = groups if groups > 1 else batch_groups
    if feat_in % groups or feat_out % g or lhs.shape[ld[0]] % batch_groups:
        raise IRVerifyError(
            f"convolution {lhs} x {rhs} -> {out}: features {feat_in} -> {feat_out} do not "
            f"divide into {g} groups"
        )
    fs = _Factors()
    gf = fs.new(g)
    n, c, o = fs.new(n_out), fs.new(feat_in // groups), fs.new(feat_out // g)
    lhs_f: list[tuple[str, ...]] = [()] * lhs.rank
    rhs_f: list[tuple[str, ...]] = [()] * rhs.rank
    out_f: list[tuple[str, ...]] = [()] * out.rank
    lhs_f[ld[0]] = fs.dim(gf, n) if batch_groups > 1 else fs.dim(n)
    lhs_f[ld[1]] = fs.dim(gf, c) if groups > 1 else fs.dim(c)
    out_f[od[0]], out_f[od[1]] = fs.dim(n), fs.dim(gf, o)
    rhs_f[rd[0]] = fs.dim(gf, o) if rhs.shape[rd[0]] == feat_out else fs.dim(o)
    rhs_f[rd[1]] = fs.dim(gf, c) if rhs.shape[rd[1]] == feat_in and groups > 1 else fs.dim(c)
    spatial: list[tuple[frozenset[str], str, bool]] = []
    for i, (dl, dr, do) in enumerate(zip(ld[2:], rd[2:], od[2:], strict=True)):
        rows = (lhs.shape[dl], rhs.shape[dr], out.shape[do])
        halo = halo_split(rows, attrs, i, window)
        if halo is not None and halo.form == "window":  # rhs rows j read lhs rows near j * step
            j, k, r = fs.new(rows[1]), fs.new(rows[2]), fs.new(halo.step)
            lhs_f[dl], rhs_f[dr], out_f[do] = fs.dim(j, r), fs.dim(j), fs.dim(k)
            spatial.append((frozenset({k, r}), j, True))
            continue
        x = "" if halo else fs.new(rows[0])
        k, y = fs.new(rows[1]), fs.new(rows[2])
        rhs_f[dr], out_f[do] = fs.dim(k), fs.dim(y)
        if halo:  # out row o reads lhs rows near o * stride: a split with a halo
            r = fs.new(halo.step)
            lhs_f[dl] = fs.dim(y, r)
            spatial.append((frozenset({k, r}), y, True))
        else:
            lhs_f[dl] = fs.dim(x)
            spatial.append((frozenset({k, x}), y, False))
    _check_sizes(fs.sizes, (lhs, rhs, out), (lhs_f, rhs_f, out_f))
    return lhs_f, rhs_f, out_f, fs.sizes, spatial, out_f[od[1]], fs.dim(n)


def _check_sizes(sizes: dict[str, int], types: tuple, factors: tuple) -> None:
    for t, dims in zip(types, factors, strict=True):
        for size, dim in zip(t.shape, dims, strict=True):
            if math.prod(sizes[f] for f in dim) != size:
                raise IRVerifyError(
                    f"convolution operand {t}: a dim of size {size} does not match the "
                    f"feature/group sizes {[sizes[f] for f in dim]} (check lhs_dims/rhs_dims/"
                    "out_dims and the group counts)"
                )


def convolution(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """XLA ConvGeneralDilated: see the module docstring."""
    groups, batch_groups = _groups(attrs)
    if groups > 1 and batch_groups > 1:  # XLA forbids it; stay safe rather than guess
        return replicated_rule(ins, outs)
    lhs_f, rhs_f, out_f, sizes, spatial, _, _ = conv_factors(
        ins[0], ins[1], outs[0], attrs, window=True
    )
    need = {f for whole, _, _ in spatial for f in whole}
    return _make([lhs_f, rhs_f], [out_f], sizes, need)


def convolution_backward(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """(grad_out, lhs, rhs) -> the gradients named by ``output_mask``: see the module
    docstring."""
    grad, lhs, rhs = ins[0], ins[1], ins[2]
    mask = tuple(bool(m) for m in attrs.get("output_mask", (True, True, True)))  # type: ignore[union-attr]
    conv_attrs = {**attrs, "rhs_dims": _rhs_dims(attrs, rhs.rank)}
    lhs_f, rhs_f, out_f, sizes, spatial, o_dim, n_dim = conv_factors(lhs, rhs, grad, conv_attrs)
    candidates = [lhs_f, rhs_f, [o_dim]]
    results = [candidates[i] for i in range(3) if mask[i]][: len(outs)]
    need = {f for whole, y, halo in spatial for f in (*whole, *(() if halo else (y,)))}
    in_results = {f for r in results for d in r for f in d}
    summed = []
    rows = tuple(y for _, y, halo in spatial if halo)  # summed into the weight/bias grads
    for factors in (n_dim + rows, tuple(f for f in o_dim if f not in lhs_f[_feature(attrs)])):
        for f in factors:
            into = tuple(k for k, r in enumerate(results) if not any(f in d for d in r))
            if f in in_results and into:
                summed.append((f, into))
    return _make([out_f, lhs_f, rhs_f], results, sizes, need, tuple(summed))


def halos(kind: str, ins: Types, outs: Types, attrs: Attrs) -> list[tuple[int, Halo]]:
    """``(lhs tensor dim, halo)`` of each spatial dim of a ``convolution`` (operands lhs, rhs)
    or torch ``convolution_backward`` (grad, lhs, rhs: the forward's geometry) that may split
    with a halo (``ir.halo``)."""
    backward = kind == "convolution_backward"
    lhs, rhs = ins[int(backward)], ins[1 + int(backward)]
    out = ins[0] if backward else outs[0]
    rhs_dims = _rhs_dims(attrs, rhs.rank) if backward else _dims(attrs, "rhs_dims", rhs.rank)
    ld, od = _dims(attrs, "lhs_dims", lhs.rank), _dims(attrs, "out_dims", out.rank)
    found = []
    for i, (dl, dr, do) in enumerate(zip(ld[2:], rhs_dims[2:], od[2:], strict=True)):
        rows = (lhs.shape[dl], rhs.shape[dr], out.shape[do])
        halo = halo_split(rows, attrs, i, window=not backward)
        if halo is not None:
            found.append((dl, halo))
    return found


def _feature(attrs: Attrs) -> int:
    return int(tuple(attrs.get("lhs_dims", (0, 1)))[1])  # type: ignore[arg-type]


def _rhs_dims(attrs: Attrs, rank: int) -> tuple[int, ...]:
    """A torch weight: ``[out, in/G, *k]``, or ``[in, out/G, *k]`` when transposed."""
    if "rhs_dims" in attrs:
        return tuple(attrs["rhs_dims"])  # type: ignore[arg-type]
    return (1, 0, *range(2, rank)) if attrs.get("transposed") else tuple(range(rank))


def _kernel_volume(rhs: TensorType, rhs_dims: tuple[int, ...]) -> int:
    return math.prod(rhs.shape[d] for d in rhs_dims[2:])


def conv_macs(lhs: TensorType, rhs: TensorType, out: TensorType, attrs: Attrs) -> float:
    """Multiply-adds that touch data: every out element sums its group's in features times the
    kernel window; with ``lhs_dilation`` (a transposed convolution) every lhs element meets
    every kernel tap for each out feature of its group instead (the zeros are skipped)."""
    ld = _dims(attrs, "lhs_dims", lhs.rank)
    rd = _dims(attrs, "rhs_dims", rhs.rank)
    od = _dims(attrs, "out_dims", out.rank)
    groups, batch_groups = _groups(attrs)
    taps = _kernel_volume(rhs, rd)
    if any(int(d) > 1 for d in attrs.get("lhs_dilation", ())):  # type: ignore[union-attr]
        per_group_out = out.shape[od[1]] // (groups * batch_groups)
        return float(lhs.numel // batch_groups * per_group_out * taps)
    per_group_in = lhs.shape[ld[1]] // groups
    return float(out.numel * per_group_in * taps)


def convolution_flops(ins: Types, outs: Types, attrs: Attrs) -> float:
    return 2.0 * conv_macs(ins[0], ins[1], outs[0], attrs)


def convolution_backward_flops(ins: Types, outs: Types, attrs: Attrs) -> float:
    """One forward's FLOPs per input/weight gradient computed, plus the bias gradient's sum."""
    grad, lhs, rhs = ins[0], ins[1], ins[2]
    mask = tuple(bool(m) for m in attrs.get("output_mask", (True, True, True)))  # type: ignore[union-attr]
    rd = _rhs_dims(attrs, rhs.rank)
    taps = _kernel_volume(rhs, rd)
    if attrs.get("transposed"):
        forward = 2.0 * lhs.numel * rhs.shape[1] * taps
    else:
        forward = 2.0 * grad.numel * rhs.shape[1] * taps
    return forward * (int(mask[0]) + int(mask[1])) + (grad.numel if mask[2] else 0.0)


register_rule("convolution", convolution, flops=convolution_flops)
register_rule("convolution_backward", convolution_backward, flops=convolution_backward_flops)


# -- pooling and resampling -------------------------------------------------------------------


def windowed(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Pooling / resampling (and their backwards) over ``attrs["window_dims"]``.

    Every other dim (batch, channels) is one factor through all the tensors. A window dim
    mixes neighbouring rows, so it needs replication in every operand; in the results it is an
    output-only factor (one per distinct size, shared by results of that size: a max pool's
    values and indices): a device may compute a slab of output rows from the whole input.
    With ``attrs["disjoint_windows"]`` (a max / avg pool whose every window lies inside its own
    stride step: kernel <= stride, no padding, no dilation) a window dim whose long tensors
    are exactly ``stride`` times its short ones splits in every tensor instead: the pooled
    rows are one factor, the long dims ``(rows, stride)`` with the stride part whole, and
    each device pools its own slab with no halo (a max pool's indices name positions in the
    whole input; ``follow_plan`` converts them, ``frontend/torch/conv_local.py``).
    """
    tensors = (*ins, *outs)
    rank = max(t.rank for t in tensors)
    if any(t.rank != rank for t in tensors):
        raise IRVerifyError(
            f"a pooling/resampling op needs operands and results of one rank, got "
            f"{[str(t) for t in tensors]}"
        )
    window = {int(d) % rank for d in attrs.get("window_dims", ())}  # type: ignore[union-attr]
    fs = _Factors()
    split = _disjoint_rows(fs, tensors, window) if attrs.get("disjoint_windows") else {}
    shared: dict[int, str] = {}
    out_window: dict[tuple[int, int], str] = {}
    need: set[str] = {f for dims in split.values() for fs_ in dims.values() for f in fs_[1:]}

    def dims_of(t: TensorType, result: bool) -> list[tuple[str, ...]]:
        dims: list[tuple[str, ...]] = []
        for d, size in enumerate(t.shape):
            if d in split:
                dims.append(fs.dim(*split[d][size]))
                continue
            if d in window and result:
                f = out_window.setdefault((d, size), fs.new(size))
            elif d in window or (d in shared and fs.sizes[shared[d]] != size):
                f = fs.new(size)
                need.add(f)
            else:
                f = shared.setdefault(d, fs.new(size))
            dims.append(fs.dim(f))
        return dims

    operands = [dims_of(t, False) for t in ins]
    results = [dims_of(t, True) for t in outs]
    return _make(operands, results, fs.sizes, need)


def _disjoint_rows(
    fs: _Factors, tensors: tuple[TensorType, ...], window: set[int]
) -> dict[int, dict[int, tuple[str, ...]]]:
    """Per window dim whose sizes are ``rows`` and ``rows * stride`` only: size -> factors
    (the shared rows, then the whole stride part of the long size)."""
    found: dict[int, dict[int, tuple[str, ...]]] = {}
    for d in sorted(window):
        sizes = {t.shape[d] for t in tensors}
        short, long = min(sizes), max(sizes)
        if len(sizes) > 2 or short < 1 or long % short:
            continue
        rows = fs.new(short)
        found[d] = {
            short: (rows,),
            long: (rows, fs.new(long // short)) if long > short else (rows,),
        }
    return found


def pixel_shuffle(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """``[..., C*r*r, H, W] -> [..., C, H*r, W*r]``: leading dims, ``C`` and the rows and
    columns (major in their output dims) pass through; the ``r`` factors need replication.
    ``pixel_unshuffle`` is the inverse (``attrs["inverse"]``)."""
    x = ins[0]
    r = int(attrs["upscale_factor"])  # type: ignore[call-overload]
    lead = "".join(FACTORS_LEAD[: x.rank - 3])
    shuffled, spread = f"{lead}(cuv)hw", f"{lead}c(hu)(wv)"
    spec = f"{spread}->{shuffled}" if attrs.get("inverse") else f"{shuffled}->{spread}"
    shapes_in, shapes_out = [x.shape], [outs[0].shape]
    return ShardingRule.from_spec(spec, shapes_in, shapes_out, "uv", sizes={"u": r, "v": r})


FACTORS_LEAD = "abdefg"
"""Letters of the leading (batch) dims of a pixel shuffle (``c h w u v`` are taken)."""

for _kind in ("max_pool", "max_pool_backward", "adaptive_max_pool", "adaptive_max_pool_backward"):
    register_rule(_kind, windowed)
for _kind in """avg_pool avg_pool_backward adaptive_avg_pool adaptive_avg_pool_backward upsample
upsample_backward""".split():
    register_rule(_kind, windowed, linear=True)
register_rule("pixel_shuffle", pixel_shuffle, flops="none", linear=True)
