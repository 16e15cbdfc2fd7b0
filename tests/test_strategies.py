"""Hand-written strategies become input pins: column/row by module name, data axes elsewhere."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.ir import Sharding
from shardplan.ir.models import TransformerConfig, training_step

TINY = TransformerConfig("tiny", 2, 64, 4, 128, 256, 16)
MESH = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")


def test_megatron_pins_column_row_and_vocab() -> None:
    graph = training_step(TINY, batch=4)
    pins = sp.strategies.megatron("tp", recompute="full").pins(graph, MESH)
    assert pins["layers_0_self_attn_q_proj_weight"] == Sharding.of(None, "tp")
    assert pins["layers_0_self_attn_o_proj_weight"] == Sharding.of("tp", None)
    assert pins["layers_1_mlp_down_proj_weight"] == Sharding.of("tp", None)
    assert pins["embed_tokens_weight"] == Sharding.of("tp", None)  # vocab-parallel
    assert pins["batch_input_ids"] == Sharding.of("dp", None)
    assert pins["layers_0_input_layernorm_weight"] == Sharding.of(None)


def test_fsdp_and_zero_shard_over_data_axes() -> None:
    graph = training_step(TINY, batch=4)
    fsdp = sp.strategies.fsdp().pins(graph, MESH)
    assert fsdp["layers_0_mlp_up_proj_weight"].shard_count(MESH) == 8  # dp x tp are data axes
    zero = sp.strategies.zero(1).pins(graph, MESH)
    assert zero["layers_0_mlp_up_proj_weight"] == Sharding.of(None, None)
    assert zero["layers_0_mlp_up_proj_weight_exp_avg"].shard_count(MESH) == 8
    with pytest.raises(ValueError, match="ZeRO stage"):
        sp.strategies.zero(4)


def test_recompute_policy_covers_every_layer() -> None:
    graph = training_step(TINY, batch=4)
    decisions = sp.strategies.dp(recompute="selective").recompute_decisions(graph)
    assert decisions == {"layers.0": "selective", "layers.1": "selective"}


def test_megatron_pins_non_square_linear_weights_through_their_transpose() -> None:
    """nn.Linear lowers to transpose + matmul; a non-square weight (GQA k/v, MLP up/down)
    must get its column/row pin like a square one (it used to stay replicated)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from shardplan.frontend.torch.capture import capture

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.empty((2, 16), dtype=torch.long, device="meta")
    graph, _ = capture(model, {"input_ids": ids, "labels": ids})
    mesh = sp.Mesh({"tp": 2}, cluster="h100-sxm")
    pins = sp.strategies.megatron("tp").pins(graph, mesh)
    layer = "model_layers_0_"
    for name in ("self_attn_k_proj", "self_attn_v_proj", "mlp_gate_proj", "mlp_up_proj"):
        assert pins[f"{layer}{name}_weight"] == Sharding.of("tp", None), name  # [out, in]
        assert pins[f"{layer}{name}_weight_exp_avg"] == Sharding.of("tp", None), name
    assert pins[f"{layer}mlp_down_proj_weight"] == Sharding.of(None, "tp")
    assert pins[f"{layer}self_attn_o_proj_weight"] == Sharding.of(None, "tp")


def test_layout_only_ops_move_no_bytes() -> None:
    from shardplan.ir import TensorType, op_bytes

    t = TensorType((8, 4), "bf16")
    assert op_bytes("transpose", [t], [TensorType((4, 8), "bf16")], [1], [1]) == 0
    assert op_bytes("reshape", [t], [TensorType((32,), "bf16")], [1], [1]) == 0
    assert op_bytes("add", [t, t], [t], [1, 2], [1]) == 64 + 32 + 64


def test_megatron_cp_splits_the_sequence_and_prices_context_parallel_attention() -> None:
    """``cp=``: the batch's sequence dim over cp; parameters replicated over it (sharded with
    the data axes under FSDP); attention then splits its queries over cp in sp.evaluate."""
    mesh = sp.Mesh({"cp": 2, "tp": 4}, cluster="h100-sxm")
    long = TransformerConfig("tiny-long", 1, 128, 4, 256, 256, 16384)
    graph = training_step(long, batch=1)
    strategy = sp.strategies.megatron(tp="tp", cp="cp")
    assert strategy.name == "megatron-cp[cp]"
    assert strategy.data_axes(mesh) == ()
    pins = strategy.pins(graph, mesh)
    assert pins["batch_input_ids"] == Sharding.of(None, "cp")
    assert pins["layers_0_self_attn_q_proj_weight"] == Sharding.of(None, "tp")
    fsdp = sp.strategies.tp_fsdp(tp="tp", cp="cp").pins(graph, mesh)
    assert "cp" in fsdp["layers_0_mlp_up_proj_weight"].used_axes
    ev = sp.evaluate(graph, mesh=mesh, strategy=strategy)
    backward = [i for i, op in enumerate(graph.ops) if op.kind == "attention_backward"]
    assert backward
    assert all(ev.plan.operand_shardings[(i, 1)].dims[2] == ("cp",) for i in backward)
    with pytest.raises(ValueError, match="different mesh axes"):
        sp.strategies.megatron(tp="tp", cp="tp")
    odd = training_step(TransformerConfig("odd", 1, 64, 4, 128, 256, 15), batch=1)
    with pytest.raises(ValueError, match="not a multiple of the cp axis"):
        strategy.pins(odd, mesh)
