"""The plans of ``bench/scale.py --quick``, byte for byte (digests; ``tests/plan_digests.py``).

Same models and meshes as the bench: Llama-3-8B shapes built by ``shardplan.ir.models`` (``ir``)
and captured from HF ``LlamaForCausalLM`` on the meta device (``torch``), 1, 4 and 32 layers on
dp=8 x tp=8 and dp=64 (the torch rows on dp=64 up to 4 layers, as the bench skips the rest), two
sequences per data-parallel rank on h100-sxm.
"""

from __future__ import annotations

import warnings

import pytest
import shardplan as sp
from plan_digests import check_plan

MESHES = {"dp=8,tp=8": {"dp": 8, "tp": 8}, "dp=64": {"dp": 64}}
ROWS = [
    (source, mesh, layers)
    for source in ("ir", "torch")
    for mesh in MESHES
    for layers in (1, 4, 32)
    if not (source == "torch" and mesh == "dp=64" and layers > 4)
]


def _model(source: str, layers: int, batch: int) -> tuple:
    if source == "ir":
        from shardplan.ir.models import LLAMA3_8B, training_step

        return training_step(LLAMA3_8B, batch=batch, layers=layers), ()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.empty((batch, 8192), dtype=torch.long, device="meta")
    return model, ({"input_ids": ids, "labels": ids},)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "mesh", "layers"), ROWS, ids=[f"{s}-{m}-L{n}" for s, m, n in ROWS]
)
def test_scale_quick_plan_is_the_recorded_one(source: str, mesh: str, layers: int) -> None:
    if source == "torch":
        pytest.importorskip("torch")
    axes = MESHES[mesh]
    model, args = _model(source, layers, batch=2 * axes["dp"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = sp.plan(model, *args, mesh=sp.Mesh(axes, cluster="h100-sxm"))
    check_plan(__file__, f"{source}-{mesh}-L{layers}", plan)
