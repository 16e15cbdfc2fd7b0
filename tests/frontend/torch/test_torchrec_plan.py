"""A TablePlan as TorchRec's ShardingPlan: TorchRec's own types and helpers accept it."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.frontend.torch.torchrec_plan import TORCHREC_SHARDING_TYPES

pytestmark = pytest.mark.torch

PINS = {
    "t_tw": "table_wise",
    "t_cw": "column_wise",
    "t_rw": "row_wise",
    "t_twrw": "table_row_wise",
    "t_grid": "grid",
    "t_dp": "data_parallel",
}


def collection():  # type: ignore[no-untyped-def]
    import torch
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(
            name=name,
            embedding_dim=256 if name == "t_grid" else 64,
            num_embeddings=1000 * (i + 1),
            feature_names=[f"f_{name}"],
            data_type=DataType.FP16,
        )
        for i, name in enumerate(PINS)
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def test_torchrec_plan_accepted_by_torchrec_types() -> None:
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan,
        ParameterSharding,
        ShardingPlan,
    )

    module = collection()
    plan = sp.plan_tables(module, world=16, pins=PINS, pooling_factors={"t_tw": 3.0})
    assert plan.by_name()["t_tw"].table.pooling_factor == 3.0
    converted = sp.torchrec_plan(plan, module, module_path="sparse.ebc")
    assert isinstance(converted, ShardingPlan)
    module_plan = converted.get_plan_for_module("sparse.ebc")
    assert isinstance(module_plan, EmbeddingModuleShardingPlan)
    assert set(module_plan) == set(PINS)
    for name, choice in plan.by_name().items():
        sharding = module_plan[name]
        assert isinstance(sharding, ParameterSharding)
        assert choice.option.sharding_type == PINS[name]
        assert sharding.sharding_type == TORCHREC_SHARDING_TYPES[PINS[name]]
        rows, dim = choice.table.rows, choice.table.dim
        if name == "t_dp":
            assert sharding.ranks == list(range(16))
            continue
        shards = sharding.sharding_spec.shards
        ranks = sorted({int(s.placement.rank()) for s in shards})
        assert ranks == list(choice.rank_set())  # TorchRec puts the shards where we planned
        covered = sum(s.shard_sizes[0] * s.shard_sizes[1] for s in shards)
        assert covered == rows * dim  # the shards tile the table exactly
        assert sharding.compute_kernel == choice.option.kernel


def test_torchrec_plan_names_a_missing_module_table() -> None:
    module = collection()
    with pytest.raises(sp.ShardplanError, match="pooling_factors names tables"):
        sp.plan_tables(module, world=16, pooling_factors={"nope": 2.0})


def test_plan_tables_reads_a_captured_graphs_bags() -> None:
    """A captured ``nn.EmbeddingBag`` model: its tables, with the example's pooling factors."""
    import torch
    from shardplan.frontend.torch.capture import capture
    from torch import nn

    class Bags(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.ModuleList([nn.EmbeddingBag(64, 16), nn.EmbeddingBag(128, 32)])

        def forward(self, ids: list, offsets: list) -> torch.Tensor:
            pooled = [e(i, o) for e, i, o in zip(self.emb, ids, offsets, strict=True)]
            return torch.cat(pooled, 1).sum(1)

    bags = 8
    ids = [torch.zeros(3 * bags, dtype=torch.long), torch.zeros(5 * bags, dtype=torch.long)]
    offsets = [torch.arange(0, 3 * bags, 3), torch.arange(0, 5 * bags, 5)]
    labels = torch.zeros(bags)
    graph, _ = capture(
        Bags(), ids, offsets, loss_fn=_squared, loss_inputs=(labels,), stamp_layers=False
    )
    plan = sp.plan_tables(graph, world=8, batch_per_rank=bags)
    specs = {c.table.name: c.table for c in plan.choices}
    assert {(s.rows, s.dim, s.pooling_factor) for s in specs.values()} == {
        (64, 16, 3.0),
        (128, 32, 5.0),
    }
    assert set(specs) == {"emb.0.weight", "emb.1.weight"}


def _squared(out, target):  # type: ignore[no-untyped-def]
    return ((out - target) ** 2).mean()


DMP_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
from torchrec.distributed.model_parallel import DistributedModelParallel
sys.path.insert(0, sys.argv[1])
from test_torchrec_plan import collection
import shardplan as sp
module = collection()
pins = {"t_tw": "table_wise", "t_rw": "row_wise", "t_cw": "column_wise"}
plan = sp.plan_tables(module, world=16, pins=pins, sharding_types=list(pins.values()),
                      kernels=["fused"])
dmp = DistributedModelParallel(module, device=torch.device("cpu"),
                               plan=sp.torchrec_plan(plan, module, device_type="cpu"))
sharded = dmp.module
print(type(sharded).__name__, sorted(dmp.plan.get_plan_for_module("")[n].sharding_type
                                     for n in pins))
"""


@pytest.mark.slow
def test_torchrec_plan_builds_distributed_model_parallel(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """TorchRec's DistributedModelParallel shards the module by the plan (fake process group,
    CPU; in a subprocess so the process group never leaks into other tests)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", DMP_SCRIPT, here], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == "ShardedEmbeddingBagCollection ['column_wise', 'row_wise', 'table_wise']"
