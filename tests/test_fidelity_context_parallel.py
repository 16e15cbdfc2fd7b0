"""The Llama 3 405B 128K context-parallel row of the fidelity bench (analytic, fast).

Its FLOP convention is unknown (dense or causal attention in the published TF/GPU), so the
row is printed apart with both implied times; each must stay within the bench's 25% worst-row
bound, and context parallelism must divide the per-GPU layer work as it should.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fidelity
import fidelity_builder
import pytest
import transformer_cost
from shardplan.costmodel.calibration import default_calibration


def test_context_parallel_row_shape_and_bounds() -> None:
    (row,) = fidelity.llama3_context_parallel_rows()
    assert row.gpus == 16384
    assert row.config.cp == 16
    text = fidelity.context_parallel_report(capture=False)
    errors = [
        float(line.rsplit("error ", 1)[1].rstrip("%")) / 100 for line in text.splitlines()[1:]
    ]
    assert len(errors) == 2
    assert all(abs(e) <= 0.25 for e in errors), text


def test_context_parallel_divides_layer_work() -> None:
    """CP 16 at 131,072 tokens: the GEMMs do 1/16 of the work, attention 1/16 of its queries."""
    (row,) = fidelity.llama3_context_parallel_rows()
    model, cp = row.model, row.config
    one = replace(cp, cp=1)
    gemms_cp, core_cp = transformer_cost._gemms(model, cp)
    gemms_one, core_one = transformer_cost._gemms(model, one)
    assert sum(gemms_one) == 16 * sum(gemms_cp)
    assert core_one == 16 * core_cp
    assert transformer_cost._cp_comm(model, one, row.cluster) == (0.0, 0.0)
    forward, backward = transformer_cost._cp_comm(model, cp, row.cluster)
    assert 0 < forward < backward  # backward gathers again and reduce-scatters dK/dV
    cal = default_calibration(row.cluster)
    f_cp, b_cp, _ = transformer_cost.layer_times(model, cp, row.cluster, cal)
    f_one, b_one, _ = transformer_cost.layer_times(model, one, row.cluster, cal)
    assert f_cp + b_cp < (f_one + b_one) / 8


@pytest.mark.slow
def test_context_parallel_row_through_sp_evaluate_on_the_builder() -> None:
    """Issue 22 point 5: the 128K row end to end through ``sp.evaluate`` on the IR builder's
    405B (126 layers, 16 x 131,072 tokens per DP rank) under ``megatron(tp, pp=16, cp="cp")``
    on the 16 x 8 x 16 x 8 mesh. Published 380 TF/GPU: 292.9 predicted (-22.9%) when causal
    attention is counted at half its FLOPs (-14.1% before issue 41's recalibration: the H100
    GEMM curve at 0.67 of peak and the fused-attention backward 1.25x slower per FLOP, both
    measured, slow this long-context row; a measured regression, bound 25%, not a fit); with it
    counted dense (the bench's convention; the paper says neither) 410.4 (+8.0%), within the
    bench's 25% worst-row bound."""
    (row,) = fidelity.llama3_context_parallel_rows()
    p = fidelity_builder.builder_prediction(row.model, row.config, row.cluster)
    causal = fidelity.causal_flops(row) / row.gpus / p.step_time / 1e12
    dense = row.flops() / row.gpus / p.step_time / 1e12
    assert abs(causal / row.published_tflops - 1) <= 0.25, causal
    assert abs(dense / row.published_tflops - 1) <= 0.25, dense
    assert causal < row.published_tflops < dense
