"""Calibration: the size-dependent GEMM curve, fitting from measurements, applying to a cluster."""

from __future__ import annotations

import json

import pytest
from shardplan.costmodel import get_cluster
from shardplan.costmodel.calibration import (
    DEFAULTS,
    Calibration,
    apply,
    default_calibration,
    fit,
    load_calibration,
)
from shardplan.costmodel.cluster import ClusterConfigError


def test_calibration_matmul_curve_saturates():
    cal = Calibration("t", matmul_efficiency=0.8, matmul_half_flops=1e9)
    assert cal.matmul_efficiency_at(1e9) == pytest.approx(0.4)
    assert cal.matmul_efficiency_at(1e15) == pytest.approx(0.8, rel=1e-5)
    assert cal.matmul_efficiency_at(1e8) < cal.matmul_efficiency_at(1e10)


def test_calibration_matmul_time_is_roofline_with_floor():
    h100 = get_cluster("h100-sxm")
    cal = Calibration("t", matmul_efficiency=0.5, matmul_half_flops=0.0, kernel_floor=1e-5)
    assert cal.matmul_time(989.4e12, 0, "bf16", h100) == pytest.approx(2.0)
    assert cal.matmul_time(1.0, 0, "bf16", h100) == pytest.approx(1e-5)
    assert cal.matmul_time(0, 0, "bf16", h100) == 0.0


def test_calibration_fit_recovers_a_known_curve():
    """Synthetic measurements from e_max = 0.75, F_half = 3e9: the linear fit is exact."""
    h100 = get_cluster("h100-sxm")
    truth = Calibration("truth", matmul_efficiency=0.75, matmul_half_flops=3e9)
    rows = [
        {"flops": f, "seconds": f / (h100.peak("bf16") * truth.matmul_efficiency_at(f)),
         "dtype": "bf16"}
        for f in (1e8, 1e9, 1e10, 1e11, 1e12)
    ]  # fmt: skip
    hbm = [{"bytes": 1e9, "seconds": 1e9 / (0.9 * h100.hbm_bandwidth)}]
    links = [{"level": "intra-node", "busbw": 0.5 * h100.intra_node.bandwidth}]
    cal = fit({"cluster": "h100-sxm", "matmul": rows, "hbm": hbm, "collectives": links})
    assert cal.matmul_efficiency == pytest.approx(0.75)
    assert cal.matmul_half_flops == pytest.approx(3e9)
    assert cal.memory_efficiency == pytest.approx(0.9)
    assert cal.intra_busbw_efficiency == pytest.approx(0.5)
    assert cal.inter_busbw_efficiency == DEFAULTS["h100-sxm"].inter_busbw_efficiency


def test_calibration_apply_returns_a_new_cluster():
    cal = Calibration("t", matmul_efficiency=0.6, memory_efficiency=0.7, intra_busbw_efficiency=0.5)
    base = get_cluster("a100-80gb")
    tuned = apply(cal, base)
    assert tuned is not base
    assert tuned.compute_efficiency == 0.6
    assert tuned.memory_efficiency == 0.7
    assert tuned.intra_node.bandwidth == pytest.approx(0.5 * base.intra_node.bandwidth)
    assert base.compute_efficiency != 0.6  # the catalogue entry is untouched


def test_calibration_json_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(DEFAULTS["a100-80gb"].to_json())
    assert load_calibration(path) == DEFAULTS["a100-80gb"]
    path.write_text(json.dumps({"name": "x", "bogus": 1}))
    with pytest.raises(ClusterConfigError, match="unknown calibration fields"):
        load_calibration(path)


def test_calibration_fit_reads_the_microbenchmark_file(tmp_path):
    """The CPU smoke output of bench/microbench_gpu.py fits without error."""
    path = tmp_path / "m.json"
    path.write_text(
        json.dumps(
            {
                "cluster": "cpu-test",
                "matmul": [{"flops": 2e6, "seconds": 1e-4}, {"flops": 2e8, "seconds": 2e-3}],
                "hbm": [{"bytes": 1e7, "seconds": 1e-3}],
            }
        )
    )
    cal = fit(path)
    assert 0 < cal.matmul_efficiency <= 1
    assert cal.name == "cpu-test-fit"


def test_calibration_defaults_exist_per_generation():
    assert default_calibration("a100-80gb") is DEFAULTS["a100-80gb"]
    assert default_calibration("h100-sxm+x").name == "h100-sxm"
    assert default_calibration("b200").source.startswith("b200 catalogue")


def test_calibration_cli_fits_a_file(tmp_path, capsys):
    from shardplan.cli import main

    path = tmp_path / "m.json"
    path.write_text(json.dumps({"cluster": "cpu-test", "hbm": [{"bytes": 1e9, "seconds": 0.02}]}))
    out = tmp_path / "cal.json"
    assert main(["calibrate", str(path), "--out", str(out)]) == 0
    assert load_calibration(out).memory_efficiency == pytest.approx(0.5)
    assert '"memory_efficiency": 0.5' in capsys.readouterr().out


def test_calibration_fit_reads_the_attention_backward_slowdown():
    """A causal >= 4K forward+backward run whose backward takes 3x its forward for 2.5x the
    FLOPs runs its backward 1.2x slower per FLOP; apply carries it onto the cluster."""
    h100 = get_cluster("h100-sxm")
    f = 1e12
    fwd = f / (0.5 * h100.peak("bf16"))
    row = {"batch": 1, "heads": 32, "seq": 8192, "head_dim": 128, "causal": True,
           "fwd_flops": f, "fwd_seconds": fwd, "fwd_bwd_flops": 3.5 * f,
           "fwd_bwd_seconds": 4 * fwd}  # fmt: skip
    cal = fit({"cluster": "h100-sxm", "attention_train": [row]})
    assert cal.attention_backward_slowdown == pytest.approx(1.2)
    assert cal.attention_backward_time(1.0) == pytest.approx(3.0)
    assert apply(cal, h100).attention_backward_slowdown == pytest.approx(1.2)
    with pytest.raises(ClusterConfigError, match="attention_backward_slowdown"):
        Calibration("t", attention_backward_slowdown=0.5)


def test_calibration_overlap_penalty_is_the_collectives_sm_share():
    """Compute under a hidden collective runs on the SMs NCCL leaves: 16 of 132 on Hopper."""
    cal = DEFAULTS["h100-sxm"]
    assert cal.comm_sm_share == pytest.approx(16 / 132)
    # 1 s of compute on 116 of 132 SMs takes 132/116 s: 16/116 s more
    assert cal.overlap_penalty(1.0) == pytest.approx(16 / 116)
    assert Calibration("t").overlap_penalty(1.0) == 0.0
    with pytest.raises(ClusterConfigError, match="comm_sm_share"):
        Calibration("t", comm_sm_share=1.0)


def test_the_cudnn_attention_kernel_is_the_h100_measurement():
    """``ATTENTION_KERNELS["h100-sxm"]["cudnn"]`` is what ``fit`` reads off the committed H100
    measurement (torch 2.11's SDPA, cuDNN on sm90); the shipped default is the FA2 entry."""
    from pathlib import Path

    from shardplan.costmodel.calibration import ATTENTION_KERNELS, with_attention_kernel

    raw = Path(__file__).resolve().parents[2] / "data/calibration/h100-sxm-measured-raw.json"
    measured = fit(raw, "h100-sxm")
    efficiency, slowdown, _ = ATTENTION_KERNELS["h100-sxm"]["cudnn"]
    assert abs(measured.attention_efficiency - efficiency) < 0.01
    assert abs(measured.attention_backward_slowdown - slowdown) < 0.01
    default = DEFAULTS["h100-sxm"]
    fa2 = ATTENTION_KERNELS["h100-sxm"]["fa2"]
    assert (default.attention_efficiency, default.attention_backward_slowdown) == fa2[:2]
    cudnn = with_attention_kernel(default, "cudnn")
    assert cudnn.attention_efficiency == efficiency
    assert cudnn.matmul_efficiency == default.matmul_efficiency
    assert apply(cudnn, "h100-sxm").attention_efficiency == efficiency
    with pytest.raises(ClusterConfigError, match=r"attention kernel 'fa3'.*known here"):
        with_attention_kernel(default, "fa3")
    with pytest.raises(ClusterConfigError, match="known here: none"):
        with_attention_kernel(DEFAULTS["a100-80gb"], "cudnn")
