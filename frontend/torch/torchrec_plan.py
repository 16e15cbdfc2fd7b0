"""A ``TablePlan`` as TorchRec's ``ShardingPlan``, and TorchRec modules as ``TableSpec`` lists.

Built only from TorchRec's public plan helpers (``torchrec.distributed.sharding_plan``:
``table_wise``, ``row_wise``, ``column_wise``, ``table_row_wise``, ``grid_shard``,
``data_parallel``, ``construct_module_sharding_plan``), so TorchRec computes the shard sizes and
offsets itself; the kernel and the UVM cache ratio are then set on each ``ParameterSharding``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from shardplan.costmodel.embedding import TableSpec
from shardplan.ir.errors import FrontendError
from shardplan.solver.table_plan import TableChoice, TablePlan

TORCHREC_DTYPES = {"FP32": "f32", "FP16": "f16", "BF16": "bf16", "INT8": "i8"}
TORCHREC_SHARDING_TYPES = {
    "data_parallel": "data_parallel", "table_wise": "table_wise", "column_wise": "column_wise",
    "row_wise": "row_wise", "table_row_wise": "table_row_wise", "grid": "grid_shard",
}  # fmt: skip
"""Our sharding type -> TorchRec's ``ShardingType`` value."""
KERNELS = {"fused": "fused", "fused_uvm_caching": "fused_uvm_caching", "fused_uvm": "fused_uvm"}


def tables_from_torchrec(
    module: object, pooling_factors: Mapping[str, float] | None = None
) -> list[TableSpec]:
    """One ``TableSpec`` per table of an ``EmbeddingBagCollection`` / ``EmbeddingCollection``.

    Args:
        module: the TorchRec module (on any device, ``meta`` included).
        pooling_factors: mean ids per sample per table name (default 1.0: TorchRec's default).
    """
    configs = getattr(module, "embedding_bag_configs", None) or getattr(
        module, "embedding_configs", None
    )
    if configs is None:
        raise FrontendError(
            f"{type(module).__name__} is not a TorchRec EmbeddingBagCollection or "
            "EmbeddingCollection; pass TableSpec values to sp.plan_tables instead"
        )
    factors = dict(pooling_factors or {})
    out = []
    for config in configs():
        dtype = TORCHREC_DTYPES.get(config.data_type.name, "f32")
        pooling = factors.pop(config.name, 1.0)
        out.append(
            TableSpec(config.name, config.num_embeddings, config.embedding_dim, pooling, dtype)
        )
    if factors:
        raise FrontendError(f"pooling_factors names tables the module lacks: {sorted(factors)}")
    return out


def to_torchrec(
    plan: TablePlan, module: object, module_path: str = "", device_type: str = "cuda"
) -> object:
    """The plan as a ``torchrec.distributed.types.ShardingPlan`` for ``module``'s tables.

    Args:
        plan: a ``TablePlan`` whose table names are ``module``'s table names.
        module: the ``EmbeddingBagCollection`` (or ``EmbeddingCollection``) it plans.
        module_path: the module's path inside the model ("" when it is the model).
        device_type: where the shards live (``"cuda"``; ``"cpu"`` for CPU runs and tests).
    """
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    world = plan.world
    generators = {c.table.name: _generator(c, world.local) for c in plan.choices}
    module_plan = construct_module_sharding_plan(
        module, generators, local_size=world.local, world_size=world.size, device_type=device_type
    )
    for name, choice in plan.by_name().items():
        _check_columns(module_plan[name], choice)
        module_plan[name] = _with_kernel(module_plan[name], choice)
    return ShardingPlan({module_path: module_plan})


def _generator(choice: TableChoice, local: int):  # type: ignore[no-untyped-def]
    from torchrec.distributed import sharding_plan as helpers

    kind = choice.option.sharding_type
    ranks = [group[0] for group in choice.ranks]
    match kind:
        case "data_parallel":
            return helpers.data_parallel()
        case "table_wise":
            return helpers.table_wise(rank=ranks[0])
        case "column_wise":
            return helpers.column_wise(ranks=ranks)
        case "row_wise":
            return helpers.row_wise()
        case "table_row_wise":
            return helpers.table_row_wise(host_index=ranks[0] // local)
        case "grid":
            return helpers.grid_shard(host_indexes=[r // local for r in ranks])
    raise FrontendError(f"sharding type {kind!r} has no TorchRec counterpart")


def _check_columns(sharding, choice: TableChoice) -> None:  # type: ignore[no-untyped-def]
    """TorchRec's grid helper picks its own column blocks; refuse a plan it cannot express."""
    if sharding.sharding_spec is None:
        return
    columns = {s.shard_offsets[1] for s in sharding.sharding_spec.shards}
    if len(columns) != choice.option.column_shards:
        raise FrontendError(
            f"table {choice.table.name!r}: planned {choice.option} but TorchRec's helper split "
            f"its {choice.table.dim} columns into {len(columns)} blocks\n  hint: plan it with "
            "sharding_types excluding 'grid' (or a dim TorchRec splits that way)"
        )


def _with_kernel(sharding, choice: TableChoice):  # type: ignore[no-untyped-def]
    """Set the planned compute kernel (and the UVM cache's load factor) on a ParameterSharding."""
    from torchrec.distributed.types import CacheParams

    option = choice.option
    if option.sharding_type == "data_parallel":
        return sharding  # TorchRec's data-parallel tables use its dense kernel
    out = replace(sharding, compute_kernel=KERNELS[option.kernel])
    if option.kernel == "fused_uvm_caching":
        out = replace(out, cache_params=CacheParams(load_factor=option.cache_ratio))
    return out
