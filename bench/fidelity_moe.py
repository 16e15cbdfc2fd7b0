"""MoE fidelity: published mixture-of-experts training throughput vs the product's prediction.

    .venv/bin/python bench/fidelity_moe.py [--json out.json]

Each row's whole HF model is captured on ``meta`` (bf16; experts through the GShard dispatch of
``frontend/torch/moe.py`` at the ``LOAD_IMBALANCE`` capacity) at one micro-batch per GPU, and
``sp.evaluate`` prices the published layout (``sp.strategies.expert_parallel``) on the row's
mesh of the calibrated H100 cluster; a step of ``GA`` micro-batches is ``GA`` times that (the
optimizer step, counted ``GA`` times, is under 1% of it on these rows). Nothing is fitted per
row: the calibration is the one every fidelity row uses (``costmodel.calibration``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity_capture import _calibrated_cluster


@dataclass(frozen=True, slots=True)
class MoERow:
    source: str
    label: str
    config: dict
    """HF config keyword arguments (the model's ``config.json``)."""
    family: str
    """``qwen3_moe`` (HF class)."""
    gpus: int
    micro_batch: int
    """Sequences per GPU per micro-batch (the source's MBS / LBS)."""
    accumulation: int
    seq: int
    published_step: float
    """Seconds per global step, from the source."""


NEMO_AUTOMODEL = (
    "NeMo Automodel performance summary, DGX-H100 BF16 pre-training table "
    "(docs.nvidia.com/nemo/automodel/nightly/performance-summary.html): Qwen3 MoE 30B on 8 GPUs, "
    "GBS 512, LBS 4, GA 16, seq 4096, EP 8, FSDP 8, TE + DeepEP, 21.773 s per global step "
    "(12,040 tokens/s/GPU, 277 model TFLOP/s/GPU)"
)

QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], tie_word_embeddings=False,
)  # fmt: skip
"""Qwen/Qwen3-30B-A3B config.json (30.5B parameters, 3.3B active per token)."""

ROWS = [
    MoERow(NEMO_AUTOMODEL, "Qwen3-30B-A3B 8xH100 EP8 FSDP8", QWEN3_30B_A3B, "qwen3_moe",
           gpus=8, micro_batch=4, accumulation=16, seq=4096, published_step=21.773),
]  # fmt: skip


def _model(row: MoERow):  # type: ignore[no-untyped-def]
    import torch

    if row.family != "qwen3_moe":
        raise ValueError(f"unknown family {row.family!r}")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**row.config)
    config._attn_implementation = "sdpa"  # the run's attention is fused (TE), not eager
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(config).to(torch.bfloat16)


def predict(row: MoERow) -> dict:
    """``sp.evaluate`` of one micro-batch step under EP over the data axis with FSDP."""
    import shardplan as sp
    import torch

    start = time.perf_counter()
    model = _model(row)
    ids = torch.zeros((row.gpus * row.micro_batch, row.seq), dtype=torch.long, device="meta")
    mesh = sp.Mesh({"dp": row.gpus}, cluster=_calibrated_cluster("h100-sxm"))
    strategy = sp.strategies.expert_parallel(shard_params=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ev = sp.evaluate(model, {"input_ids": ids, "labels": ids}, mesh=mesh, strategy=strategy,
                         memory_limit=math.inf)  # fmt: skip
    step = ev.step_time * row.accumulation
    return {
        "label": row.label, "published_s": row.published_step, "predicted_s": step,
        "error": step / row.published_step - 1, "micro_step_s": ev.step_time,
        "peak_gib": ev.peak_memory_bytes / 2**30, "wall_s": time.perf_counter() - start,
        "strategy": strategy.name, "row": asdict(row),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    for row in ROWS:
        r = predict(row)
        results.append(r)
        print(f"{r['label']:34s} published {r['published_s']:7.2f} s  predicted "
              f"{r['predicted_s']:7.2f} s  error {r['error']:+.1%}  ({r['strategy']}, "
              f"peak {r['peak_gib']:.1f} GiB, {r['wall_s']:.0f} s)", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
