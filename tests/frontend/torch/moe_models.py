"""Test-only mixture-of-experts models (shared by test_moe.py and test_moe_emission.py)."""

from __future__ import annotations

import torch

VOCAB, BATCH, SEQ = 128, 8, 64


def tiny_mixtral(layers: int = 1) -> torch.nn.Module:
    """HF Mixtral, hidden 64, 8 experts, top-2, SDPA attention, seeded weights."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model
