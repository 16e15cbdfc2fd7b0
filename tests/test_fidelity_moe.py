"""MoE fidelity (issue 41): the Mixtral-8x22B row, a second published large-MoE run.

The record checks read ``bench/records/fidelity_moe.json``; the live check prices the row again
through the bench (about 30 s: the whole 56-layer model on ``meta``, its pipeline priced by
``sp.evaluate``), so the record cannot drift from the cost model unnoticed.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fidelity_moe

RECORD = Path(__file__).resolve().parents[1] / "bench" / "records" / "fidelity_moe.json"
LABEL = "Mixtral-8x22B 128xH100 TP2 PP8 EP8"


def _row() -> fidelity_moe.MoERow:
    (row,) = [r for r in fidelity_moe.ROWS if r.label == LABEL]
    return row


def _recorded() -> dict:
    (result,) = [r for r in json.loads(RECORD.read_text())["results"] if r["label"] == LABEL]
    return result


def test_mixtral_row_of_record_is_within_25_percent():
    recorded, row = _recorded(), _row()
    assert recorded["row"] == json.loads(json.dumps(asdict(row)))  # recorded from this row
    assert recorded["published_s"] == pytest.approx(row.published_step, rel=1e-12)
    assert recorded["error"] == pytest.approx(recorded["predicted_s"] / row.published_step - 1)
    assert abs(recorded["error"]) <= 0.25, recorded["error"]
    assert recorded["compute_s"] < recorded["predicted_s"]  # a device's compute, no bubble


def test_the_published_step_is_megatrons_model_flops_at_470_tflops():
    """470 TFLOP/s per GPU as seconds per step, counted matmul by matmul (forward; training
    is three times it): Q, K, V and output projections, QK^T and AV over the whole sequence,
    two SwiGLU experts per token (three GEMMs each) and the logits."""
    c = fidelity_moe.MIXTRAL_8X22B
    h, f, s, vocab = c["hidden_size"], c["intermediate_size"], 4096, c["vocab_size"]
    q = c["head_dim"] * c["num_attention_heads"]
    kv = c["head_dim"] * c["num_key_value_heads"]
    layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 2 * s * q + 2 * 3 * 2 * h * f
    per_token = 3 * (c["num_hidden_layers"] * layer + 2 * h * vocab)
    step = 256 * s * per_token / (128 * 470e12)
    assert _row().published_step == pytest.approx(step, rel=1e-12)
    assert 4.3 < step < 4.45


def test_the_row_captures_experts_at_capacity_one_on_a_pipeline():
    row = _row()
    assert row.capacity_factor == 1.0  # the token-drop run (capacity 1.0, padded)
    assert row.mesh == {"pp": 8, "dp": 2, "ep": 4, "tp": 2}
    assert row.gpus == 128
    assert row.accumulation * 2 * 4 * row.micro_batch == 256  # GBS over DP 8 = dp x ep
    assert row.overrides == {"pp": 8, "microbatches": 32, "sequence_parallel": True,
                             "tp_comm_overlap": True}  # fmt: skip


@pytest.mark.torch
def test_the_mixtral_row_priced_now_matches_its_record():
    recorded = _recorded()
    now = fidelity_moe.predict(_row())
    assert now["predicted_s"] == pytest.approx(recorded["predicted_s"], rel=1e-6)
    assert now["compute_s"] == pytest.approx(recorded["compute_s"], rel=1e-6)
    assert abs(now["error"]) <= 0.25


@pytest.mark.parametrize(
    ("label", "bound"),
    [("Qwen3-235B-A22B 256xH100 TP2 EP8 FSDP", 0.20), ("Qwen3-30B-A3B 8xH100 EP8 FSDP8", 0.15)],
)
def test_qwen3_rows_of_record_are_priced_with_deepeps_dispatch(label: str, bound: float):
    """Both runs used DeepEP: their rows price the deduplicated dispatch, and the record is of
    the row as defined. The bounds are issue 41's."""
    (row,) = [r for r in fidelity_moe.ROWS if r.label == label]
    (recorded,) = [r for r in json.loads(RECORD.read_text())["results"] if r["label"] == label]
    assert row.dispatcher == "deepep"
    assert recorded["row"] == json.loads(json.dumps(asdict(row)))
    assert recorded["error"] == pytest.approx(recorded["predicted_s"] / row.published_step - 1)
    assert abs(recorded["error"]) <= bound, recorded["error"]


def test_the_30b_row_is_captured_as_its_benchmark_recipe_ran():
    """NeMo Automodel's qwen3_moe_30b_te_deepep.yaml: fake balanced gate (capacity 1.0),
    activation checkpointing of every block, cross-entropy without the fp32 upcast."""
    (row,) = [r for r in fidelity_moe.ROWS if r.label.startswith("Qwen3-30B-A3B")]
    assert row.capacity_factor == 1.0
    assert row.strategy == {"shard_params": True, "recompute": "full"}
    assert row.loss_upcast is False
    assert row.attention == "cudnn"  # backend: attn: te (TE on Hopper: cuDNN's attention)
    assert row.fused_norms  # backend: rms_norm: te
    assert row.gpus * row.micro_batch * row.accumulation == 512  # GBS


def test_records_count_the_optimizer_update_once_per_step():
    """A step is GA micro-batches of forward and backward and one update; a pipelined row's
    schedule prices its update itself."""
    for result in json.loads(RECORD.read_text())["results"]:
        row = result["row"]
        if (row["overrides"] or {}).get("pp", 1) > 1:
            assert result["update_s"] == 0.0
            assert result["predicted_s"] == pytest.approx(
                result["micro_step_s"] * row["accumulation"]
            )
            continue
        assert 0 < result["update_s"] < result["micro_step_s"]
        step = result["micro_step_s"] * row["accumulation"] + result["update_s"]
        assert result["predicted_s"] == pytest.approx(step, rel=1e-12)
        assert result["compute_s"] < result["predicted_s"]


@pytest.mark.torch
def test_the_bf16_loss_captures_no_fp32_logits():
    """``loss_upcast=False`` captures the cross-entropy on the bf16 logits: no fp32 tensor of
    the logits' size in the graph (HF's loss upcasts them)."""
    import dataclasses

    (row,) = [r for r in fidelity_moe.ROWS if r.label.startswith("Qwen3-30B-A3B")]
    small = dict(row.config, num_hidden_layers=1, num_experts=8, vocab_size=16384)
    logits = 8 * 4 * 128 * 16384  # 8 GPUs x micro-batch 4 x seq 128 x vocab
    sizes, evaluations = {}, {}
    for upcast in (True, False):
        tiny = dataclasses.replace(row, config=small, seq=128, loss_upcast=upcast)
        ev, _ = evaluations[upcast] = fidelity_moe._evaluate(tiny, None)
        sizes[upcast] = [
            v for op in ev.plan.graph.ops for v in op.results
            if v.type.dtype == "f32" and v.type.numel >= logits
        ]  # fmt: skip
    assert sizes[True]  # HF's loss: the logits upcast
    assert not sizes[False]
    # the update counted once per step is the optimizer's ops, with no matmul among them
    ev, _ = evaluations[False]  # the row's own capture
    rest, update = fidelity_moe._split(ev)
    optimizer = [op for op in ev.plan.graph.ops if op.origin.module == "optimizer"]
    assert optimizer
    assert not [op for op in optimizer if op.kind == "matmul"]
    assert 0 < update < rest
    assert rest + update == pytest.approx(ev.step_time)


def test_every_row_is_priced_with_te_kernels_on_hopper():
    """All three runs are Transformer Engine on H100: cuDNN fused attention, fused RMSNorm."""
    for row in fidelity_moe.ROWS:
        assert (row.attention, row.fused_norms) == ("cudnn", True), row.label
