"""The README's main job: plan a Llama-3.2-1B-shaped HF model's training step on 8 H100s.

The model is built by ``transformers`` from a config on the ``meta`` device (no weights are
downloaded or allocated) and captured as forward + loss + backward + AdamW through torch.fx.

    shardplan plan examples/llama_demo.py:make --mesh dp=2,tp=4 --cluster h100-sxm
"""

from __future__ import annotations


def make(layers: int = 16, batch: int = 8, seq: int = 2048):
    """``(model, example_args)`` for ``shardplan.plan``: Llama-3.2-1B shapes, ``layers`` deep."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=seq,
        tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.empty((batch, seq), dtype=torch.long, device="meta")
    return model, ({"input_ids": ids, "labels": ids},)
