"""A planned decode step on simulated ranks equals the plain HF model's next-token logits.

The reference runs HF's own ``StaticCache``: the prompt fills ``CONTEXT - 1`` slots, then one
token is decoded. The planned step applies the plan (``plan.apply``), puts the prompt's cache
in the plan's layouts (``distribute_cache``) and decodes the same token through ``slot_cache``
on every simulated rank (``LocalTensorMode``: real numerics). Cells: the free plan, and
Megatron pins with the cache split by KV heads, on (2,) and (2, 2).
"""

from __future__ import annotations

import copy

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.serving import distribute_cache, slot_cache
from shardplan.ir import Role
from torch.distributed.device_mesh import init_device_mesh

pytestmark = [pytest.mark.torch, pytest.mark.slow]

CONTEXT, VOCAB = 16, 256


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "sdpa"
    return model


def _reference(model: torch.nn.Module, batch: int):  # type: ignore[no-untyped-def]
    """(next token ids, cache after the prompt, next-token logits) with HF's StaticCache."""
    from transformers import StaticCache

    torch.manual_seed(batch)
    prompt = torch.randint(0, VOCAB, (batch, CONTEXT - 1))
    token = torch.randint(0, VOCAB, (batch, 1))
    cache = StaticCache(config=model.config, max_cache_len=CONTEXT)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
        buffers = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
        logits = model(token, past_key_values=cache, use_cache=True).logits
    return token, buffers, logits


CELLS = [  # (mesh axes, batch, Megatron pins)
    ({"tp": 2}, 4, False),
    ({"tp": 2}, 1, True),
    ({"dp": 2, "tp": 2}, 4, True),
]


@pytest.mark.parametrize(("axes", "batch", "megatron"), CELLS, ids=["free-2", "meg-2", "meg-2x2"])
def test_decode_step_matches_the_plain_model(llama, axes, batch, megatron) -> None:  # type: ignore[no-untyped-def]
    token, buffers, expected = _reference(llama, batch)
    mesh = sp.Mesh(axes, cluster="h100-sxm")
    options = {"mode": "decode", "context_len": CONTEXT}
    if megatron:
        strategy = sp.strategies.megatron("tp")
        plan = sp.evaluate(llama, token, mesh=mesh, strategy=strategy, **options).plan
        for v in plan.graph.inputs:  # the cache follows the column-split k/v projections
            if v.role is Role.KV_CACHE:
                assert plan.shardings[v.name].dims[1] == ("tp",)
    else:
        plan = sp.plan(llama, token, mesh=mesh, **options)
    simulate.simulated_world(mesh.size)
    device_mesh = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    position = torch.arange(CONTEXT - 1, CONTEXT)
    with simulate.local_ranks(mesh.size), torch.no_grad():
        sharded = plan.apply(copy.deepcopy(llama), device_mesh)
        cache = slot_cache(distribute_cache(plan, device_mesh, buffers), position, CONTEXT)
        out = sharded(input_ids=token, past_key_values=cache, position_ids=position[None],
                      use_cache=True)  # fmt: skip
        logits = simulate.rank0(out.logits)
        written = [simulate.rank0(layer.keys) for layer in cache.layers]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    for layer, mine in zip(buffers[::2], written, strict=True):  # the prompt's slots kept
        torch.testing.assert_close(mine[:, :, : CONTEXT - 1], layer[:, :, : CONTEXT - 1])
