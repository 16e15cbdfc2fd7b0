"""A tiny Hugging Face GPT2LMHeadModel (no weights downloaded), planned and trained on 4 ranks.

Run: ``python examples/hf_gpt2.py``. Tests import ``make()``, which returns ``(model, inputs)``
with HF keyword inputs ``{"input_ids": ids, "labels": ids}``. GPT-2 ties its input and output
embeddings and uses ``Conv1D`` projections (``addmm`` with a [in, out] weight), so it also
exercises tied parameters and layouts ``parallelize_module`` styles cannot express.
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
    vocab: int = 128,
    device: str = "cpu",
    seed: int = 0,
) -> tuple[nn.Module, tuple]:
    """A small GPT-2 (dropout off, so steps are deterministic) and HF keyword inputs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max(64, seq),
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return model, ({"input_ids": ids, "labels": ids},)


def main() -> None:
    import shardplan as sp
    from checks import print_placements, torch_check

    model, inputs = make()
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"))
    print(plan)
    print_placements(plan)
    torch_check(plan, model, inputs)


if __name__ == "__main__":
    main()
