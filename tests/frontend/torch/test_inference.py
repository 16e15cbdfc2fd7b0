"""Serving plans: prefill / decode steps of HF Llama with a static KV cache (``serving.py``).

The cache is a graph input of role ``KV_CACHE`` written in place (its new contents an output
aliased to it); memory counts it once, exactly; the plan splits it by KV heads under tensor
parallelism; a cache that cannot fit is refused with the bytes it is over by; the throughput
objective picks a larger batch than the latency objective, and decode is memory-bound.
"""

from __future__ import annotations

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch.capture import capture
from shardplan.ir import FrontendError, InfeasiblePlanError, Role
from shardplan.ir.errors import ArgumentError

pytestmark = pytest.mark.torch

CONTEXT, BATCH = 16, 4


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _cache_bytes(layers, kv_heads, head_dim, context, batch, itemsize, shards) -> int:  # type: ignore[no-untyped-def]
    """The issue's formula: 2 x layers x kv_heads x head_dim x context x batch x bytes / shards."""
    return 2 * layers * kv_heads * head_dim * context * batch * itemsize // shards


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return _tiny_llama()


@pytest.fixture(scope="module")
def decode_plan(tiny):  # type: ignore[no-untyped-def]
    ids = torch.randint(0, 256, (BATCH, 1))
    mesh = sp.Mesh({"tp": 2}, cluster="h100-sxm")
    return sp.plan(tiny, ids, mesh=mesh, mode="decode", context_len=CONTEXT)


def test_decode_capture_has_an_in_place_cache(tiny) -> None:
    graph, context = capture(tiny, torch.randint(0, 256, (BATCH, 1)), mode="decode",
                             context_len=CONTEXT)  # fmt: skip
    caches = [v for v in graph.inputs if v.role is Role.KV_CACHE]
    assert len(caches) == 2 * 2  # key and value per layer
    assert all(v.type.shape == (BATCH, 2, CONTEXT, 16) for v in caches)
    assert sorted(context.cache_values) == [
        f"model.layers.{i}.self_attn.{kind}_cache" for i in (0, 1) for kind in ("key", "value")
    ]
    index = {v.name: n for n, v in enumerate(graph.inputs)}
    aliased = {graph.inputs[i].name for i in graph.output_aliases.values()}
    assert aliased == {v.name for v in caches}
    for j, i in graph.output_aliases.items():  # each output is the write into its own input
        write = graph.outputs[j].producer
        assert write is not None
        assert write.kind == "index_copy"
        assert write.operands[0].name == graph.inputs[i].name
        assert index[write.operands[0].name] == i
        assert write.attrs["dim"] == 2  # the sequence slot of [batch, kv_heads, slot, head_dim]


def test_decode_plan_counts_the_cache_once_and_exactly(decode_plan) -> None:
    memory = decode_plan.memory_breakdown().by_category
    shards = {decode_plan.shardings[v.name].shard_count(decode_plan.mesh)
              for v in decode_plan.graph.inputs if v.role is Role.KV_CACHE}  # fmt: skip
    assert len(shards) == 1
    assert memory["kv_cache"] == _cache_bytes(2, 2, 16, CONTEXT, BATCH, 4, shards.pop())
    assert "parameter_copies" not in memory  # weight views alias the weights in a serving step
    report = decode_plan.serving
    assert report.mode == "decode"
    assert report.batch == BATCH
    assert report.tokens_per_step == BATCH
    assert report.step_time == decode_plan.step_time
    assert report.tokens_per_second_per_device == pytest.approx(
        BATCH / decode_plan.step_time / decode_plan.mesh.size
    )
    assert "per-token latency" in str(decode_plan)


@pytest.mark.slow
def test_llama3_8b_decode_cache_is_exact_and_split_by_kv_heads() -> None:
    """The issue's acceptance: Llama-3-8B shapes (meta), tp=8, batch 64, context 4096.

    Both the free plan and the TP-only serving baseline split the cache by KV heads. The
    free plan was data-parallel attention (cache by batch, weights replicated) while a
    double-counted memory bound made the planner solve this step only with followers
    merged; solved exactly it is Megatron TP with one all-reduce per block (9.54 ms against
    10.28 ms modelled), never slower than the baseline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.zeros((64, 1), dtype=torch.long, device="meta")
    mesh = sp.Mesh({"tp": 8}, cluster="h100-sxm")
    options = {"mode": "decode", "context_len": 4096}
    free = sp.plan(model, ids, mesh=mesh, **options)
    tp_only = sp.evaluate(model, ids, mesh=mesh, strategy=sp.strategies.megatron("tp"),
                          **options).plan  # fmt: skip
    exact = _cache_bytes(32, 8, 128, 4096, 64, 2, 8)
    assert exact == 4 * 2**30
    for plan in (free, tp_only):
        memory = plan.memory_breakdown().by_category
        assert memory["kv_cache"] == exact
        caches = [v for v in plan.graph.inputs if v.role is Role.KV_CACHE]
        assert len(caches) == 64
        assert all(plan.shardings[v.name].shard_count(mesh) == 8 for v in caches)
    for plan in (free, tp_only):  # [batch, kv_heads, slot, head_dim]: heads over tp
        for v in plan.graph.inputs:
            if v.role is Role.KV_CACHE:
                assert plan.shardings[v.name].dims == ((), ("tp",), (), ())
    assert {c.kind for c in free.collectives()} == {"all-reduce"}
    assert free.step_time <= tp_only.step_time * (1 + 1e-9)
    roofline = free.serving.roofline
    assert roofline.bound == "memory"
    assert roofline.cache_bytes == exact
    assert roofline.weight_bytes == free.memory_breakdown().by_category["parameters"]
    assert roofline.bytes >= roofline.cache_bytes  # a decode step reads its whole cache
    assert roofline.memory_seconds > 5 * roofline.math_seconds  # far below the ridge point


def test_a_cache_that_cannot_fit_is_refused_by_how_much(tiny) -> None:
    ids = torch.randint(0, 256, (BATCH, 1))
    mesh = sp.Mesh({"tp": 2}, cluster="h100-sxm")
    with pytest.raises(InfeasiblePlanError, match=r"KV cache does not fit.* over the .* limit"):
        sp.plan(tiny, ids, mesh=mesh, mode="decode", context_len=4096, memory_limit="2MiB")


def test_throughput_takes_a_larger_batch_than_latency(tiny) -> None:
    ids = torch.randint(0, 256, (1, 1))
    mesh = sp.Mesh({"tp": 2}, cluster="h100-sxm")
    latency = sp.plan(tiny, ids, mesh=mesh, mode="decode", context_len=CONTEXT,
                      objective="latency")  # fmt: skip
    throughput = sp.plan(tiny, ids, mesh=mesh, mode="decode", context_len=CONTEXT,
                         objective="throughput", max_batch=4)  # fmt: skip
    assert latency.serving.batch == 1
    assert throughput.serving.batch > latency.serving.batch
    table = {c.batch: c for c in throughput.serving.candidates}
    assert sorted(table) == [1, 2, 4]
    best = max(table.values(), key=lambda c: c.tokens_per_second_per_device)
    assert best.batch == throughput.serving.batch
    assert "tokens/s per device" in throughput.serving.reason
    assert throughput.serving.tokens_per_second_per_device > (
        latency.serving.tokens_per_second_per_device
    )


def test_prefill_writes_the_prompt_into_the_cache(tiny) -> None:
    ids = torch.randint(0, 256, (2, 8))
    plan = sp.plan(tiny, ids, mesh=sp.Mesh({"tp": 2}, cluster="h100-sxm"), mode="prefill",
                   context_len=CONTEXT)  # fmt: skip
    report = plan.serving
    assert report.mode == "prefill"
    assert report.tokens_per_step == 2 * 8
    writes = [op for op in plan.graph.ops if op.kind == "index_copy"]
    assert len(writes) == 4
    assert all(op.operands[2].type.shape[2] == 8 for op in writes)
    assert plan.memory_breakdown().by_category["kv_cache"] == _cache_bytes(
        2, 2, 16, CONTEXT, 2, 4, plan.shardings[writes[0].operands[0].name].shard_count(plan.mesh)
    )


def test_serving_arguments_are_checked(tiny) -> None:
    one = torch.randint(0, 256, (BATCH, 1))
    mesh = sp.Mesh({"tp": 2}, cluster="h100-sxm")
    with pytest.raises(FrontendError, match="context_len"):
        capture(tiny, one, mode="decode")
    with pytest.raises(FrontendError, match=r"\[batch, 1\]"):
        capture(tiny, torch.randint(0, 256, (BATCH, 3)), mode="decode", context_len=CONTEXT)
    with pytest.raises(FrontendError, match="context_len >= the prompt"):
        capture(tiny, torch.randint(0, 256, (BATCH, 32)), mode="prefill", context_len=CONTEXT)
    with pytest.raises(ArgumentError, match="objective"):
        sp.plan(tiny, one, mesh=mesh, mode="decode", context_len=CONTEXT, objective="speed")
    with pytest.raises(ArgumentError, match="mode='decode'"):
        sp.plan(tiny, one, mesh=mesh, objective="throughput")
    with pytest.raises(ArgumentError, match="max_batch"):
        sp.plan(tiny, one, mesh=mesh, mode="decode", context_len=CONTEXT, max_batch=0)


def test_serving_baselines_lay_the_cache_out_as_serving_engines_do(tiny) -> None:
    """Replicated DP splits the cache by batch; TP-only by KV heads (replicated over a ``tp``
    wider than the KV heads); TP x PP by KV heads inside each stage."""
    ids = torch.randint(0, 256, (BATCH, 1))
    expected = {
        (("dp", 2), ("tp", 2)): {"dp": (("dp", "tp"), ()), "megatron": (("dp",), ("tp",))},
        (("tp", 4),): {"megatron": ((), ())},  # 2 KV heads on tp=4: replicated over it
        (("pp", 2), ("tp", 2)): {"megatron": ((), ("tp",))},
    }
    for axes, layouts in expected.items():
        mesh = sp.Mesh(dict(axes), cluster="h100-sxm")
        names = [s.name for s in sp.strategies.serving(mesh)]
        assert names == (["megatron"] if mesh.axis_names[0] == "pp" else ["dp", "megatron"])
        for strategy in sp.strategies.serving(mesh):
            if strategy.name not in layouts:
                continue
            result = sp.evaluate(tiny, ids, mesh=mesh, strategy=strategy, mode="decode",
                                 context_len=CONTEXT)  # fmt: skip
            plan = result.plan
            for v in plan.graph.inputs:
                if v.role is Role.KV_CACHE:
                    assert plan.shardings[v.name].dims[:2] == layouts[strategy.name], axes
            assert plan.step_time > 0


def test_gpt2_decode_has_its_cache_too() -> None:
    """Another family: multi-head attention, learned positions, Conv1D projections."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    mesh = sp.Mesh({"tp": 2}, cluster="h100-sxm")
    ids = torch.zeros((BATCH, 1), dtype=torch.long)
    plan = sp.plan(model, ids, mesh=mesh, mode="decode", context_len=CONTEXT)
    caches = [v for v in plan.graph.inputs if v.role is Role.KV_CACHE]
    assert [v.origin.path for v in caches] == [
        f"transformer.h.{i}.attn.{kind}_cache" for i in (0, 1) for kind in ("key", "value")
    ]
    shards = plan.shardings[caches[0].name].shard_count(mesh)
    assert plan.memory_breakdown().by_category["kv_cache"] == _cache_bytes(
        2, 4, 16, CONTEXT, BATCH, 4, shards
    )
