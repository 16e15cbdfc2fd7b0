"""What-if sweeps on a Llama-70B-shaped layer: a table and a PNG come out."""

from __future__ import annotations

import pytest
from shardplan.api.whatif import scale_cluster, whatif
from shardplan.costmodel import get_cluster
from shardplan.ir import Mesh
from shardplan.ir.models import LLAMA3_70B, training_step


def test_whatif_llama70b_layer_table_and_png(tmp_path):
    graph = training_step(LLAMA3_70B, batch=1, layers=1, seq=1024)
    png = tmp_path / "whatif.png"
    result = whatif(
        graph,
        mesh=Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm"),
        vary={"link_bandwidth": [0.5, 1, 2, 4], "flops": [1, 2]},
        repeat=LLAMA3_70B.layers,
        plot=png,
        time_limit=20,
    )
    table = result.table()
    assert "link_bandwidth" in table
    assert "flops" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    link = [r for r in result.rows if r.parameter == "link_bandwidth"]
    assert [r.factor for r in link] == [0.5, 1.0, 2.0, 4.0]
    # faster links never make the (re-planned) step slower
    steps = [r.step_time for r in link]
    assert steps == sorted(steps, reverse=True)
    flops = [r for r in result.rows if r.parameter == "flops"]
    assert flops[1].compute_time < flops[0].compute_time


def test_whatif_scale_cluster_scales_one_parameter():
    base = get_cluster("h100-sxm")
    fast = scale_cluster(base, "inter_bandwidth", 2)
    assert fast.inter_node.bandwidth == pytest.approx(2 * base.inter_node.bandwidth)
    assert fast.intra_node == base.intra_node
    assert scale_cluster(base, "hbm_capacity", 0.5).hbm_capacity == base.hbm_capacity // 2
    with pytest.raises(ValueError, match="cannot vary"):
        scale_cluster(base, "color", 2)


def test_whatif_cli_prints_a_table(tmp_path, capsys):
    from shardplan.cli import main

    png = tmp_path / "w.png"
    code = main([
        "whatif", "examples/mlp_graph.py", "--mesh", "dp=2,tp=4", "--cluster", "h100-sxm",
        "--vary", "link_bandwidth=0.5,2", "--plot", str(png),
    ])  # fmt: skip
    assert code == 0
    assert "link_bandwidth" in capsys.readouterr().out
    assert png.exists()
