"""``sp.plan_tables``: plan a recommendation model's embedding tables with its dense part."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..costmodel.dense_part import DENSE_MODES, DenseSpec
from ..costmodel.embedding import TableSpec, make_world
from ..ir.graph import Graph
from ..solver.table_plan import TablePlan
from ..solver.table_planner import plan_tables as _plan_tables
from ..solver.table_specs import tables_from_graph


def plan_tables(
    tables: Sequence[TableSpec] | object,
    *,
    world: int,
    cluster: str = "h100-sxm",
    batch_per_rank: int = 512,
    dense: DenseSpec | None = None,
    optimizer: str = "rowwise_adagrad",
    pooling_factors: dict[str, float] | None = None,
    hbm_limit: float | None = None,
    host_limit: float | None = None,
    sharding_types: Iterable[str] | None = None,
    kernels: Iterable[str] | None = None,
    pins: dict[str, str] | None = None,
    dense_modes: Sequence[str] = DENSE_MODES,
    time_limit: float = 5.0,
) -> TablePlan:
    """Per-table sharding (TorchRec's types and kernels) and the dense mode, in one decision.

    Args:
        tables: ``TableSpec`` values, a captured ``Graph`` (its ``embedding_bag`` ops' tables),
            or a TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection`` (its tables are
            read; ``pooling_factors`` by table name).
        world: ranks (whole nodes of the cluster's ``devices_per_node``).
        cluster: a catalogue name (``h100-sxm``, ``a100-80gb``, ...).
        batch_per_rank: samples per rank per iteration.
        dense: the dense layers (``DenseSpec``), priced as DDP or FSDP; ``None``: tables only.
        optimizer: the fused sparse optimizer: ``rowwise_adagrad``, ``adagrad``, ``adam`` or
            ``sgd``.
        hbm_limit, host_limit: bytes per rank (defaults: the cluster's HBM; 2 TB per node).
        sharding_types, kernels, dense_modes: restrict the choices.
        pins: table name -> the sharding type it must take.
        time_limit: solver seconds.
    Returns:
        A ``TablePlan``: ``print(plan)`` for the per-table summary; ``sp.torchrec_plan(plan,
        module)`` for TorchRec's ``ShardingPlan``.
    """
    specs = list(tables) if isinstance(tables, list | tuple) else None
    if isinstance(tables, Graph):
        specs = tables_from_graph(tables)
    elif specs is None:
        from ..frontend.torch.torchrec_plan import tables_from_torchrec

        specs = tables_from_torchrec(tables, pooling_factors)
    resolved = make_world(world, cluster, batch_per_rank, optimizer)
    return _plan_tables(
        specs, resolved, dense, hbm_limit=hbm_limit, host_limit=host_limit,
        sharding_types=sharding_types, kernels=kernels, pins=pins, dense_modes=dense_modes,
        time_limit=time_limit,
    )  # fmt: skip


def torchrec_plan(
    plan: TablePlan, module: object, module_path: str = "", device_type: str = "cuda"
) -> object:
    """The plan as TorchRec's ``ShardingPlan`` for ``module`` (an ``EmbeddingBagCollection``)."""
    from ..frontend.torch.torchrec_plan import to_torchrec

    return to_torchrec(plan, module, module_path, device_type)
