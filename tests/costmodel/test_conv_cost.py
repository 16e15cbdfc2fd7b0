"""Convolutions priced as implicit GEMMs (``costmodel/conv.py``) and their calibration hook."""

from __future__ import annotations

import pytest
from shardplan.costmodel.calibration import apply, default_calibration, fit
from shardplan.costmodel.cluster import get_cluster
from shardplan.costmodel.compute import compute_time
from shardplan.costmodel.conv import conv_work_factor, tile_utilisation
from shardplan.ir import Graph, TensorType, op_bytes, op_flops

T = TensorType


def _conv(x, w, out, groups=1):  # type: ignore[no-untyped-def]
    g = Graph("c")
    a, b = g.add_input("x", T(x, "f16")), g.add_input("w", T(w, "f16"))
    return g.add_op("convolution", [a, b], [T(out, "f16")], attrs={"feature_group_count": groups})


def test_tile_utilisation_quantises_channels_and_reduction() -> None:
    assert tile_utilisation(64, 64, 9) == 1.0  # 3x3, 64 -> 64: full tiles
    assert tile_utilisation(256, 1024, 1) == 1.0
    stem = tile_utilisation(64, 3, 49)  # 3 channels padded to 8 (392), in K steps of 32 (416)
    assert stem == pytest.approx(147 / 416)
    assert tile_utilisation(4, 4, 9, groups=32) == pytest.approx(36 / 96)  # ResNeXt 32x4d
    assert tile_utilisation(1, 1, 9, groups=64) == 0.0  # depthwise: no GEMM


def _seconds(op, cluster):  # type: ignore[no-untyped-def]
    ins, outs = [v.type for v in op.operands], [r.type for r in op.results]
    flops = op_flops(op.kind, op.rule, ins, outs, op.attrs) * conv_work_factor(op, cluster)
    nbytes = op_bytes(op.kind, ins, outs, [1] * len(ins), [1] * len(outs))
    return compute_time(flops, nbytes, "f16", cluster), flops, nbytes


def test_depthwise_is_memory_bound_and_a_full_conv_runs_at_gemm_efficiency() -> None:
    h100 = get_cluster("h100-sxm")
    dw = _conv((256, 64, 56, 56), (64, 1, 3, 3), (256, 64, 56, 56), groups=64)
    seconds, flops, nbytes = _seconds(dw, h100)
    assert flops == 0
    assert seconds == pytest.approx(nbytes / (h100.hbm_bandwidth * h100.memory_efficiency))
    full = _conv((256, 64, 56, 56), (64, 64, 3, 3), (256, 64, 56, 56))
    seconds, flops, _ = _seconds(full, h100)
    assert flops == 2 * 256 * 64 * 56 * 56 * 64 * 9
    assert seconds == pytest.approx(flops / (h100.peak("f16") * h100.compute_efficiency))
    stem = _conv((256, 3, 224, 224), (64, 3, 7, 7), (256, 64, 112, 112))
    assert conv_work_factor(stem) == pytest.approx(416 / 147)


def test_conv_efficiency_is_fitted_from_microbench_rows_and_applied() -> None:
    """Rows made at 0.55 of peak over their tile utilisation fit back to 0.55; the calibrated
    cluster then prices a full-tile convolution at 0.55 of peak instead of the GEMM's."""
    base = get_cluster("a100-80gb")
    rows = []
    for c, k, r in ((64, 64, 3), (256, 256, 3), (3, 64, 7), (1024, 256, 1)):
        flops = 2.0 * 256 * 56 * 56 * k * c * r * r
        used = tile_utilisation(k, c, r * r)
        seconds = flops / (base.peak("f16") * 0.55 * used)
        rows.append({"in_channels": c, "out_channels": k, "kernel": r, "groups": 1,
                     "dtype": "f16", "flops": flops, "seconds": seconds})  # fmt: skip
    cal = fit({"cluster": "a100-80gb", "conv": rows})
    assert cal.conv_efficiency == pytest.approx(0.55)
    assert default_calibration("a100-80gb").conv_efficiency == 0.0  # shipped: the GEMM's
    cluster = apply(cal, base)
    assert cluster.conv_efficiency == pytest.approx(0.55)
    full = _conv((256, 64, 56, 56), (64, 64, 3, 3), (256, 64, 56, 56))
    seconds, flops, _ = _seconds(full, cluster)
    raw = op_flops(full.kind, full.rule, [v.type for v in full.operands],
                   [r.type for r in full.results], full.attrs)  # fmt: skip
    assert seconds == pytest.approx(raw / (cluster.peak("f16") * 0.55))


def test_nchw_convolutions_pay_a_transpose_of_each_activation_per_cudnn_call() -> None:
    """On a ``nchw_convolutions`` cluster a forward convolution transposes its input and its
    result (each read and written once at HBM bandwidth); a backward's data-gradient call the
    output gradient and the input gradient, its weight-gradient call the output gradient and
    the input. Split over the batch, each device transposes its shard. A depthwise
    convolution (a direct kernel) and a channels-last cluster transpose nothing."""
    from shardplan.costmodel.cluster import nchw_convolutions
    from shardplan.costmodel.conv import layout_bytes, layout_time
    from shardplan.ir import Mesh, Sharding

    base = get_cluster("a100-80gb")
    nchw = nchw_convolutions(base)
    assert nchw.name == "a100-80gb+nchw"
    assert not base.nchw_convolutions
    mesh = Mesh({"dp": 4}, cluster="a100-80gb")
    x_shape, y_shape = (256, 64, 56, 56), (256, 128, 56, 56)
    fwd = _conv(x_shape, (128, 64, 3, 3), y_shape)
    batch, whole = Sharding((("dp",), (), (), ())), Sharding.replicated(4)
    x_bytes, y_bytes = T(x_shape, "f16").nbytes // 4, T(y_shape, "f16").nbytes // 4
    assert layout_bytes(fwd, [batch, whole], [batch], mesh) == [x_bytes, y_bytes]
    bandwidth = base.hbm_bandwidth * base.memory_efficiency
    seconds = layout_time(fwd, [batch, whole], [batch], mesh, nchw)
    assert seconds == pytest.approx(2 * (x_bytes + y_bytes) / bandwidth)
    assert layout_time(fwd, [batch, whole], [batch], mesh, base) == 0.0

    g = Graph("b")
    grad, x, w = (g.add_input(n, T(s, "f16")) for n, s in
                  (("g", y_shape), ("x", x_shape), ("w", (128, 64, 3, 3))))  # fmt: skip
    for mask, expected in (
        ((True, True, False), [y_bytes, x_bytes, y_bytes, x_bytes]),
        ((False, True, False), [y_bytes, x_bytes]),  # the first layer: no input gradient
    ):
        outs = ([T(x_shape, "f16")] if mask[0] else []) + [T((128, 64, 3, 3), "f16")]
        bwd = g.add_op("convolution_backward", [grad, x, w], outs, attrs={"output_mask": mask})
        results = [batch] * mask[0] + [whole]
        assert layout_bytes(bwd, [batch, batch, whole], results, mesh) == expected
    dw = _conv((256, 64, 56, 56), (64, 1, 3, 3), (256, 64, 56, 56), groups=64)
    assert layout_bytes(dw, [batch, whole], [batch], mesh) == []
