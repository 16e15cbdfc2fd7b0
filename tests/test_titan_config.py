"""TitanConfig: torchtitan's overrides both ways, its checks, its strategy (no torch)."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.solver.titan_config import TitanConfig, TitanConfigError


def test_titan_config_overrides_round_trip() -> None:
    """Every field survives overrides() -> from_overrides(), in both override spellings."""
    config = TitanConfig(
        dp_replicate=2, dp_shard=4, cp=2, tp=4, pp=2, local_batch_size=8, seq_len=8192,
        ac_mode="selective", selective_ac_option="2", pipeline_schedule="Interleaved1F1B",
        microbatch_size=2, mixed_precision_param="float32", flavor="8B",
    )  # fmt: skip
    assert TitanConfig.from_overrides(config.overrides()) == config
    joined = [
        f"{k}={v}" for k, v in zip(config.overrides()[::2], config.overrides()[1::2], strict=True)
    ]
    assert TitanConfig.from_overrides(joined) == config
    sections = config.to_dict()
    assert sections["parallelism"]["tensor_parallel_degree"] == 4
    assert sections["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}
    assert config.world_size == 2 * 4 * 2 * 4 * 2
    assert config.global_batch_size == 64
    assert config.microbatches == 4


def test_titan_config_bad_input_names_the_fix() -> None:
    with pytest.raises(TitanConfigError, match=r"tp must be"):
        TitanConfig(tp=0)
    with pytest.raises(TitanConfigError, match=r"does not price.*compile\.enable"):
        TitanConfig.from_overrides(["--compile.enable", "True"])
    with pytest.raises(TitanConfigError, match=r"activation_checkpoint\.mode 'some'"):
        TitanConfig(ac_mode="some")
    with pytest.raises(TitanConfigError, match="expected int"):
        TitanConfig.from_overrides("--parallelism.tensor_parallel_degree two")


def test_titan_config_problems_are_torchtitans_checks() -> None:
    """The degree product, the head split, tp x 2 cp dividing seq_len, the pipeline's
    micro-batches and stages; a valid configuration has none."""
    good = TitanConfig(dp_shard=8, tp=8, local_batch_size=2, seq_len=8192)
    assert good.problems(64, 32, 32, 8) == []
    problems = TitanConfig(dp_shard=4, tp=16, seq_len=100).problems(32, 32, 32, 8)
    assert any("world size 32" in p for p in problems)
    assert any("KV heads (8)" in p for p in problems)
    assert any("tp * 2 * cp = 32" in p for p in problems)
    piped = TitanConfig(dp_shard=8, pp=8, local_batch_size=4, seq_len=8192)
    assert any("fewer than the 8 stages" in p for p in piped.problems(64, 32, 32, 8))
    with pytest.raises(TitanConfigError, match="world size"):
        good.check(32, 32, 32, 8)


def test_titan_config_strategy_is_torchtitans_plan() -> None:
    """FSDP over dp_shard x cp, HSDP replicas, Megatron TP with SP, every-n-th-layer AC."""
    config = TitanConfig(dp_replicate=2, dp_shard=2, cp=2, tp=4, ac_mode="selective",
                         selective_ac_option="2")  # fmt: skip
    strategy = config.strategy()
    mesh = config.mesh()
    assert mesh.axis_names == ("dp_replicate", "dp_shard", "cp", "tp")
    strategy.check(mesh)
    assert strategy.tp == "tp"
    assert strategy.sequence_parallel
    assert strategy.shard_params
    assert strategy.shard_axes(mesh) == ("dp_shard", "cp")
    assert strategy.data_axes(mesh) == ("dp_replicate", "dp_shard")
    assert (strategy.recompute, strategy.recompute_every) == ("full", 2)
    assert sp.strategies.torchtitan(dp_shard=8).shard_axes(sp.Mesh({"dp_shard": 8})) == (
        "dp_shard",
    )
