"""Hand-written strategies become input pins: column/row by module name, data axes elsewhere."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.ir import Sharding
from shardplan.models import TransformerConfig, training_step

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
