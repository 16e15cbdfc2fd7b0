"""Embedding-table planning side by side with TorchRec's planner (issue 38, points 2, 3, 5).

    .venv/bin/python bench/recsys.py --quick     # TorchRec's planner on Criteo + small DLRM-A
    .venv/bin/python bench/recsys.py             # + TorchRec on DLRM-A 4,096 tables (minutes)
    .venv/bin/python bench/recsys.py --out bench/results

Models:
- **DLRM-A** (MAD-Max, Hsia et al., ISCA'24, arXiv 2310.02784, its table of model
  configurations, as quoted in issue 38): 4,096 tables of 2.08M rows x dim 94 in FP16 (1.49
  TiB), a 1.2 GB dense part, batch 512 per rank. Pooling factor 1 (TorchRec's default; the
  paper's figure is not on the reference sheet).
- **Criteo Terabyte DLRM** (MLPerf Training DLRM-DCNv2 reference, mlcommons/training
  ``recommendation_v2/torchrec_dlrm``: ``--num_embeddings_per_feature`` and
  ``--multi_hot_sizes`` below, dim 128, FP32; bottom MLP 13-512-256-128, DCN 3 layers of
  low-rank 512, top MLP 1024-1024-512-256-1).

For every model and world size (8, 64, 128 H100 ranks, nodes of 8): our plan (``sp.plan_tables``,
dense DDP or FSDP chosen with the tables) with its planning time, modelled iteration and peak HBM
per rank; TorchRec's ``EmbeddingShardingPlanner(topology=Topology(world_size=W,
compute_device="cuda", hbm_cap=80 GiB), batch_size=512)`` plan and its planning time where it is
run; each plan priced by **TorchRec's estimator** (``EmbeddingEnumerator`` with
``EmbeddingPerfEstimator`` and ``EmbeddingStorageEstimator``, public planner API: each table's
option enumerated with its sharding type and kernel pinned, the shard perfs summed per rank as
our placement or TorchRec's ``ShardingPlan`` puts them, the max over ranks: TorchRec's critical
path) and by **ours** (TorchRec's plan priced with DDP dense, its tables as placed). TorchRec
plans DLRM-A for minutes: the anchor row gives issue 38's measurement, labelled as such.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import shardplan as sp
from shardplan.costmodel.dense_part import DenseSpec
from shardplan.costmodel.embedding import Option, TableSpec, make_world, price
from shardplan.solver.table_plan import TableChoice
from shardplan.solver.table_planner import evaluate_choices

GIB = 2**30
CRITEO_ROWS = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip
CRITEO_POOLING = [
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
]  # fmt: skip
TORCHREC_ANCHOR = {
    "dlrm-a/64": {"plan_s": 453.0, "estimate_ms": 105.6, "rss_gb": 2.9, "tables": "all TWRW"},
    "dlrm-a/128": {"plan_s": 635.0, "rss_gb": 5.2},
    "dlrm-a/8": {"plan_s": 216.0, "note": "insufficient storage after 390 s; UVM forced: 216 s"},
    "criteo/8": {"plan_s": 0.73},
    "criteo/64": {"plan_s": 5.8},
}
"""Issue 38's measurements on this machine (torchrec 1.9.2; proposal loop capped at 60 s)."""


def dlrm_a(tables: int = 4096) -> tuple[list[TableSpec], DenseSpec]:
    specs = [TableSpec(f"t{i}", 2_080_000, 94, 1.0, "f16") for i in range(tables)]
    return specs, DenseSpec(param_bytes=1.2e9)


def criteo() -> tuple[list[TableSpec], DenseSpec]:
    specs = [
        TableSpec(f"cat_{i}", rows, 128, float(pool), "f32")
        for i, (rows, pool) in enumerate(zip(CRITEO_ROWS, CRITEO_POOLING, strict=True))
    ]
    sizes = [13, 512, 256, 128]
    params = sum(a * b + b for a, b in itertools.pairwise(sizes))
    inter = 26 * 128 + 128
    params += 3 * (2 * inter * 512 + inter)  # DCN v2: low-rank U, V and a bias per layer
    top = [inter, 1024, 1024, 512, 256, 1]
    params += sum(a * b + b for a, b in itertools.pairwise(top))
    return specs, DenseSpec(param_bytes=4.0 * params)


# ---- TorchRec side (public planner API only) --------------------------------------------


def torchrec_topology(world: int):  # type: ignore[no-untyped-def]
    from torchrec.distributed.planner import Topology

    return Topology(world_size=world, compute_device="cuda", hbm_cap=80 * GIB)


def torchrec_collection(tables: list[TableSpec]):  # type: ignore[no-untyped-def]
    import torch
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    dtypes = {"f16": DataType.FP16, "f32": DataType.FP32, "bf16": DataType.BF16}
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.rows,
            feature_names=[f"f_{t.name}"],
            data_type=dtypes[t.dtype],
        )
        for t in tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def constraints(tables: list[TableSpec], **pinned):  # type: ignore[no-untyped-def]
    from torchrec.distributed.planner import ParameterConstraints

    return {
        t.name: ParameterConstraints(pooling_factors=[t.pooling_factor], **pinned) for t in tables
    }


def torchrec_plan(tables: list[TableSpec], world: int, batch: int):  # type: ignore[no-untyped-def]
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    planner = EmbeddingShardingPlanner(
        topology=torchrec_topology(world), batch_size=batch, constraints=constraints(tables)
    )
    start = time.perf_counter()
    plan = planner.plan(torchrec_collection(tables), [_sharder()])
    return plan.get_plan_for_module(""), time.perf_counter() - start


def _sharder():  # type: ignore[no-untyped-def]
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder()


class TorchRecEstimator:
    """TorchRec's per-shard perf and storage for one table under a pinned type and kernel."""

    def __init__(self, world: int, batch: int) -> None:
        self.world, self.batch = world, batch
        self.cache: dict[tuple, object] = {}

    def option(self, table: TableSpec, kind: str, kernel: str, ratio: float | None):  # type: ignore[no-untyped-def]
        key = (table.shape_key(), kind, kernel, ratio)
        if key not in self.cache:
            self.cache[key] = self._enumerate(table, kind, kernel, ratio)
        return self.cache[key]

    def _enumerate(self, table: TableSpec, kind: str, kernel: str, ratio: float | None):  # type: ignore[no-untyped-def]
        from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
        from torchrec.distributed.planner.shard_estimators import (
            EmbeddingPerfEstimator,
            EmbeddingStorageEstimator,
        )
        from torchrec.distributed.types import CacheParams

        topology = torchrec_topology(self.world)
        extra = {"cache_params": CacheParams(load_factor=ratio)} if ratio else {}
        pinned = constraints([table], sharding_types=[kind], compute_kernels=[kernel], **extra)
        estimators = [
            EmbeddingPerfEstimator(topology, constraints=pinned),
            EmbeddingStorageEstimator(topology, constraints=pinned),
        ]
        enumerator = EmbeddingEnumerator(
            topology=topology, batch_size=self.batch, constraints=pinned, estimator=estimators
        )
        options = enumerator.enumerate(torchrec_collection([table]), [_sharder()])
        if not options:
            raise RuntimeError(f"TorchRec offers no {kind}/{kernel} option for {table.name}")
        return options[0]


def torchrec_cost_of_ours(plan, estimator: TorchRecEstimator) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Our placement under TorchRec's estimator: (max over ranks of shard perf, peak HBM)."""
    time_ms = [0.0] * plan.world.size
    hbm = [0.0] * plan.world.size
    for choice in plan.choices:
        option = choice.option
        kind = {"grid": "grid_shard"}.get(option.sharding_type, option.sharding_type)
        kernel = "dense" if kind == "data_parallel" else option.kernel
        ratio = option.cache_ratio if option.kernel == "fused_uvm_caching" else None
        sharding = estimator.option(choice.table, kind, kernel, ratio)
        shards = sharding.shards
        ours = [r for group in choice.ranks for r in group]
        # TorchRec splits columns its own way: spread its total over our shards by width.
        total_perf = sum(s.perf.total for s in shards)
        total_hbm = sum(s.storage.hbm for s in shards)
        for r in ours:
            time_ms[r] += total_perf / len(ours)
            hbm[r] += total_hbm / len(ours)
    return max(time_ms), max(hbm)


def torchrec_cost_of_theirs(module_plan, tables, estimator) -> tuple[float, float, list]:  # type: ignore[no-untyped-def]
    """TorchRec's own plan under its estimator, and its placement as our ``TableChoice``s."""
    by_name = {t.name: t for t in tables}
    time_ms = [0.0] * estimator.world
    hbm = [0.0] * estimator.world
    choices = []
    for name, sharding in module_plan.items():
        table = by_name[name]
        ratio = sharding.cache_params.load_factor if sharding.cache_params else None
        if sharding.compute_kernel == "fused_uvm_caching" and ratio is None:
            ratio = 0.2  # TorchRec's default cache load factor
        option = estimator.option(table, sharding.sharding_type, sharding.compute_kernel, ratio)
        ranks = list(sharding.ranks or range(estimator.world))
        for shard, rank in zip(option.shards, ranks, strict=False):
            time_ms[rank] += shard.perf.total
            hbm[rank] += shard.storage.hbm
        choices.append(our_choice(table, sharding, ranks, ratio, estimator.world))
    return max(time_ms), max(hbm), choices


def our_choice(table, sharding, ranks, ratio, world_size) -> TableChoice:  # type: ignore[no-untyped-def]
    """TorchRec's placement of one table priced by our cost model (same ranks)."""
    kind = sharding.sharding_type
    kernel = "fused" if sharding.compute_kernel == "dense" else sharding.compute_kernel
    world = _WORLDS[world_size]
    if kind == "table_row_wise" and len(ranks) > world.local:
        kind = "row_wise"  # rows over more than a node: TorchRec's one-host topology
    option = Option(kind, kernel, ratio or 1.0, 1)
    if kind == "column_wise":
        option = Option(kind, kernel, ratio or 1.0, len(ranks))
    cost = price(table, option, world)
    if cost.placement == "all":
        groups = (tuple(range(world_size)),)
    elif cost.placement == "node":
        groups = (tuple(ranks),)
    else:
        groups = tuple((r,) for r in ranks)
    return TableChoice(table, cost, groups)


_WORLDS: dict[int, object] = {}


# ---- the rows ------------------------------------------------------------------------------


def run_row(model: str, tables, dense, world: int, batch: int, run_torchrec: bool) -> dict:  # type: ignore[no-untyped-def]
    _WORLDS[world] = make_world(world, "h100-sxm", batch)
    start = time.perf_counter()
    ours = sp.plan_tables(tables, world=world, batch_per_rank=batch, dense=dense)
    ours_s = time.perf_counter() - start
    estimator = TorchRecEstimator(world, batch)
    tr_ours_ms, tr_ours_hbm = torchrec_cost_of_ours(ours, estimator)
    row = {
        "model": model, "world": world, "tables": len(tables),
        "ours_plan_s": ours_s, "ours_iteration_ms": ours.iteration_time * 1e3,
        "ours_sparse_ms": ours.sparse_time * 1e3, "ours_dense_mode": ours.dense_mode,
        "ours_peak_hbm_gib": ours.peak_hbm / GIB,
        "ours_under_torchrec_ms": tr_ours_ms, "ours_torchrec_hbm_gib": tr_ours_hbm / GIB,
        "ours_types": sorted({str(c.option) for c in ours.choices}),
    }  # fmt: skip
    if run_torchrec:
        module_plan, theirs_s = torchrec_plan(tables, world, batch)
        tr_ms, tr_hbm, choices = torchrec_cost_of_theirs(module_plan, tables, estimator)
        priced = evaluate_choices(choices, _WORLDS[world], dense, "ddp")
        row.update(
            torchrec_plan_s=theirs_s, torchrec_under_torchrec_ms=tr_ms,
            torchrec_hbm_gib=tr_hbm / GIB, torchrec_under_ours_ms=priced.iteration_time * 1e3,
            torchrec_types=sorted({f"{s.sharding_type}/{s.compute_kernel}"
                                   for s in module_plan.values()}),
        )  # fmt: skip
    anchor = TORCHREC_ANCHOR.get(f"{model}/{world}")
    if anchor:
        row["torchrec_anchor_issue38"] = anchor
    return row


def twrw_baseline(tables, dense, world: int, batch: int) -> dict:  # type: ignore[no-untyped-def]
    """Issue 38's TorchRec DLRM-A plan (every table table-row-wise) rebuilt: both estimators."""
    from torchrec.distributed.types import ParameterSharding

    _WORLDS[world] = make_world(world, "h100-sxm", batch)
    estimator = TorchRecEstimator(world, batch)
    plan = {
        t.name: ParameterSharding("table_row_wise", "fused", list(range(world))) for t in tables
    }
    tr_ms, tr_hbm, choices = torchrec_cost_of_theirs(plan, tables, estimator)
    priced = evaluate_choices(choices, _WORLDS[world], dense, "ddp")
    return {
        "torchrec_twrw_under_torchrec_ms": tr_ms, "torchrec_twrw_hbm_gib": tr_hbm / GIB,
        "torchrec_twrw_under_ours_ms": priced.iteration_time * 1e3,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="TorchRec only on small models")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    rows = []
    for world in (8, 64, 128):
        rows.append(run_row("criteo", *criteo(), world, args.batch, True))
        print_row(rows[-1])
        tables, dense = dlrm_a()
        row = run_row("dlrm-a", tables, dense, world, args.batch, not args.quick)
        if world > 8:
            row.update(twrw_baseline(tables, dense, world, args.batch))
        rows.append(row)
        print_row(rows[-1])
    if args.quick:  # TorchRec on a DLRM-A slice it plans in seconds
        small, dense = dlrm_a(64)
        rows.append(run_row("dlrm-a-64tables", small, dense, 8, args.batch, True))
        print_row(rows[-1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recsys.json").write_text(json.dumps(rows, indent=1, default=str))
    print(f"wrote {out / 'recsys.json'}")


def print_row(row: dict) -> None:
    def ms(key: str) -> str:
        value = row.get(key)
        return "-" if value is None or math.isnan(value) else f"{value:.2f}"

    print(
        f"{row['model']:<16} W={row['world']:<4} ours {row['ours_plan_s']:.2f} s "
        f"{ms('ours_iteration_ms')} ms ({row['ours_dense_mode']}), TorchRec-est "
        f"{ms('ours_under_torchrec_ms')} ms, HBM {row['ours_peak_hbm_gib']:.1f} GiB | TorchRec "
        f"{ms('torchrec_plan_s')} s, TorchRec-est {ms('torchrec_under_torchrec_ms')} ms, ours-est "
        f"{ms('torchrec_under_ours_ms')} ms | TWRW rebuilt: TorchRec-est "
        f"{ms('torchrec_twrw_under_torchrec_ms')} ms, ours-est {ms('torchrec_twrw_under_ours_ms')}",
        flush=True,
    )


if __name__ == "__main__":
    main()
