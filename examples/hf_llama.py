"""A tiny Hugging Face LlamaForCausalLM (no weights downloaded), planned on the README's 2x4
mesh and checked on 8 simulated ranks.

Run: ``python examples/hf_llama.py``. Tests import ``make()``, which returns ``(model, inputs)``
with HF keyword inputs ``{"input_ids": ids, "labels": ids}`` (the model computes its own loss).
"""

from __future__ import annotations

import torch
from torch import nn


def make(
    batch: int = 4,
    seq: int = 16,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 128,
    tie: bool = False,
    device: str = "cpu",
    seed: int = 0,
) -> tuple[nn.Module, tuple]:
    """A small Llama and HF-style keyword inputs; ``device="meta"`` allocates nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max(64, seq), tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return model, ({"input_ids": ids, "labels": ids},)


def main() -> None:
    import shardplan as sp
    from checks import print_placements, torch_check

    model, inputs = make()
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 4}, cluster="cpu-test"))
    print(plan)
    print_placements(plan)
    torch_check(plan, model, inputs)


if __name__ == "__main__":
    main()
