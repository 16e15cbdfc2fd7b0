"""Pricing one embedding table under TorchRec's sharding types and compute kernels.

Notation: ``B`` batch per rank, ``W`` ranks, ``Bg = B*W`` the global batch, ``L`` the pooling
factor (ids per sample), ``R x D`` the table, ``e`` bytes per element, ``i = 8`` bytes per id,
``n`` the ranks sharing a row-split, ``k`` column shards (each ``D/k`` wide).

| sharding type  | shards on               | ids/shard | shard     | output dist (fwd)        |
|----------------|-------------------------|-----------|-----------|--------------------------|
| data_parallel  | every rank              | B*L       | R x D     | none; grad AR of R*D*e   |
| table_wise     | one rank                | Bg*L      | R x D     | all-to-all of Bg*D*e     |
| column_wise    | k ranks                 | Bg*L      | R x D/k   | all-to-all of Bg*D/k*e   |
| row_wise       | all W ranks             | Bg*L/W    | R/W x D   | reduce-scatter of Bg*D*e |
| table_row_wise | the n ranks of one node | Bg*L/n    | R/n x D   | RS in node, a2a across   |
| grid           | k nodes, n ranks each   | Bg*L/n    | R/n x D/k | as table_row_wise, D/k   |

These are TorchRec's sharding types and its per-shard accounting (``torchrec/distributed/
planner/shard_estimators.py``, public docs "Sharding types"): a shard's time is charged to the
rank holding it, and the iteration's sparse time is the max over ranks of the sum of their
shards' times. Per shard (forward + backward):

- **lookup** (fwd): ``ids * (D_s*e) * (hit / hbm + miss / host)`` with ``hbm`` the cluster's HBM
  bandwidth times its memory efficiency (roofline, ref §3 "Efficiency defaults") and ``host``
  the host link (PCIe Gen5 x16, 64 GB/s per direction: NVIDIA H100 datasheet; an assumption, not
  on the reference sheet). ``hit`` is the HBM-cache hit rate, 1 for the fused kernel, 0 for pure
  UVM, and ``ratio ** (1 - locality)`` for a cache holding ``ratio`` of the rows (locality 0:
  uniform access, the conservative bound; a user with skewed ids sets it).
- **backward + fused optimizer** (fbgemm's TBE fuses the sparse update into backward): read the
  gradient row, read and write the weight row and its optimizer state, at the same split of
  HBM and host bandwidth: ``ids * (3*D_s*e + 2*state_row)``. Optimizer state per row
  (``OPTIMIZER_STATE``): row-wise Adagrad one fp32 (4 B); Adagrad (one accumulator per element,
  HugeCTR's and fbgemm's exact Adagrad) ``D`` fp32; Adam ``2*D`` fp32; SGD none.
- **input dist**: the all-to-all of ids, ``ids * i`` received per shard.
- **output dist** and its backward (gradients of the pooled embeddings back): all-to-all
  (table/column-wise), reduce-scatter then all-gather (row-wise), reduce-scatter in the node plus
  an all-to-all across nodes (table-row-wise, grid), each priced by ``collectives.collective_time``
  (alpha-beta, ring ``(n-1)/n``, all-to-all over one NIC across nodes; that module's docstring).
  Alphas are charged once per collective kind per iteration (``fixed_latency``), not per table:
  TorchRec batches every table of a sharding type into one collective.
- **data_parallel**: local lookups, and an all-reduce of the dense table gradient ``R*D*e``.
- **memory per shard** (HBM): rows * D_s * e plus state for the fused kernel; for caching,
  ``ratio`` of that plus the cache's index (8 B per cached row, fbgemm's ``lxu_cache_state``);
  for pure UVM nothing but the buffers; host memory holds the rest. Buffers: ids and the pooled
  outputs and their gradients, ``ids*i + 2*Bg*D_s*e``. Data-parallel adds the dense gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardplan.ir.errors import TableSpecError
from shardplan.ir.mesh import Mesh

from .cluster import Cluster, get_cluster
from .collectives import collective_time
from .links import group_link

SHARDING_TYPES = (
    "data_parallel",
    "table_wise",
    "column_wise",
    "row_wise",
    "table_row_wise",
    "grid",
)
KERNELS = ("fused", "fused_uvm_caching", "fused_uvm")
OPTIMIZER_STATE = {"rowwise_adagrad": "row", "adagrad": "d", "adam": "2d", "sgd": "none"}
ID_BYTES = 8
HOST_BANDWIDTH = 64e9
"""PCIe Gen5 x16 per direction (NVIDIA H100 SXM datasheet; an assumption: not on ref §3)."""
CACHE_INDEX_BYTES = 8


@dataclass(frozen=True, slots=True)
class TableSpec:
    """One embedding table as the table planner sees it.

    Invariants: rows, dim >= 1; pooling_factor > 0; bytes_per_element in {1, 2, 4, 8};
    0 <= locality < 1 (hit rate of a cache of ratio c is ``c ** (1 - locality)``).

    Example: ``TableSpec("t0", rows=2_080_000, dim=94, pooling_factor=1.0, dtype="f16")``.
    """

    name: str
    rows: int
    dim: int
    pooling_factor: float = 1.0
    dtype: str = "f32"
    locality: float = 0.0

    def __post_init__(self) -> None:
        if self.rows < 1 or self.dim < 1:
            raise TableSpecError(
                f"table {self.name!r}: rows={self.rows} dim={self.dim}; both must be >= 1"
            )
        if not self.pooling_factor > 0:
            raise TableSpecError(
                f"table {self.name!r}: pooling_factor={self.pooling_factor}; give the mean "
                "number of ids per sample (> 0)"
            )
        if self.dtype not in DTYPE_BYTES:
            raise TableSpecError(
                f"table {self.name!r}: dtype {self.dtype!r} unknown; one of {sorted(DTYPE_BYTES)}"
            )
        if not 0 <= self.locality < 1:
            raise TableSpecError(f"table {self.name!r}: locality={self.locality} not in [0, 1)")

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.dim * self.element_bytes

    def shape_key(self) -> tuple:
        """Everything but the name: tables with equal keys are priced alike (one class)."""
        return (self.rows, self.dim, self.pooling_factor, self.dtype, self.locality)


DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f8": 1, "i8": 1, "f64": 8}


@dataclass(frozen=True, slots=True)
class Option:
    """A way to shard one table: sharding type, compute kernel, cache ratio, column shards."""

    sharding_type: str
    kernel: str = "fused"
    cache_ratio: float = 1.0
    column_shards: int = 1

    def __str__(self) -> str:
        kernel = self.kernel
        if kernel == "fused_uvm_caching":
            kernel = f"uvm-cache {self.cache_ratio:.0%}"
        cols = f" x{self.column_shards} cols" if self.column_shards > 1 else ""
        return f"{self.sharding_type}{cols} ({kernel})"


@dataclass(frozen=True, slots=True)
class OptionCost:
    """One option's shard prices. ``placement``: ``all`` (one shard on every rank), ``rank``
    (``groups`` shards on distinct ranks) or ``node`` (``groups`` node-groups on distinct
    nodes, every rank of a node holding one shard)."""

    option: Option
    placement: str
    groups: int
    time: float
    """Seconds per shard (fwd + bwd), charged to its rank."""
    hbm: float
    host: float
    breakdown: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class World:
    """Ranks and their cluster: ``nodes`` nodes of ``local`` ranks."""

    size: int
    cluster: Cluster
    batch_per_rank: int
    optimizer: str = "rowwise_adagrad"

    @property
    def local(self) -> int:
        return min(self.size, self.cluster.devices_per_node)

    @property
    def nodes(self) -> int:
        return self.size // self.local

    @property
    def mesh(self) -> Mesh:
        return world_mesh(self.size, self.cluster, self.local)


@lru_cache(maxsize=64)
def world_mesh(size: int, cluster: str | Cluster, local: int) -> Mesh:
    """``{"node": W/local, "local": local}`` (``local`` innermost: inside a node)."""
    if size <= local:
        return Mesh({"local": size}, cluster=cluster)
    return Mesh({"node": size // local, "local": local}, cluster=cluster)


def make_world(
    size: int, cluster: str | Cluster, batch_per_rank: int, optimizer: str = "rowwise_adagrad"
) -> World:
    """A validated ``World`` (ranks fill whole nodes; the optimizer is known)."""
    resolved = get_cluster(cluster)
    if optimizer not in OPTIMIZER_STATE:
        raise TableSpecError(f"optimizer {optimizer!r} unknown; one of {sorted(OPTIMIZER_STATE)}")
    local = min(size, resolved.devices_per_node)
    if size < 1 or size % local:
        raise TableSpecError(
            f"world={size} does not fill whole nodes of {resolved.devices_per_node} devices "
            f"({resolved.name}); use a multiple of {resolved.devices_per_node} or fewer ranks"
        )
    if batch_per_rank < 1:
        raise TableSpecError(f"batch_per_rank={batch_per_rank}; give the per-rank batch (>= 1)")
    return World(size, resolved, batch_per_rank, optimizer)


def state_row_bytes(table: TableSpec, dim: int, optimizer: str) -> int:
    """Optimizer state bytes per row of a ``dim``-wide shard (module docstring)."""
    kind = OPTIMIZER_STATE[optimizer]
    return {"row": 4, "d": 4 * dim, "2d": 8 * dim, "none": 0}[kind]


def bandwidth_time(kind: str, nbytes: float, axes: tuple[str, ...], world: World) -> float:
    """Seconds of a collective without its alpha (alphas are paid once: ``fixed_latency``)."""
    if nbytes <= 0 or not axes:
        return 0.0
    mesh = world.mesh
    seconds = collective_time(kind, nbytes, axes, mesh, world.cluster)
    if seconds == 0.0:
        return 0.0
    return max(0.0, seconds - group_link(axes, mesh, world.cluster).latency)


def fixed_latency(kinds: set[str], world: World) -> float:
    """One alpha per collective kind per iteration (fwd and bwd: two each), over all ranks."""
    axes = world.mesh.axis_names
    if world.size == 1:
        return 0.0
    return 2 * len(kinds) * group_link(axes, world.mesh, world.cluster).latency


def lookup_time(ids: float, dim: int, table: TableSpec, option: Option, world: World) -> float:
    """Forward lookups plus the backward's fused optimizer update (module docstring)."""
    hit = cache_hit_rate(table, option)
    hbm = world.cluster.hbm_bandwidth * world.cluster.memory_efficiency
    per_byte = hit / hbm + (1 - hit) / min(HOST_BANDWIDTH, hbm)
    row = dim * table.element_bytes
    state = state_row_bytes(table, dim, world.optimizer)
    return ids * (row + 3 * row + 2 * state) * per_byte


def cache_hit_rate(table: TableSpec, option: Option) -> float:
    if option.kernel == "fused":
        return 1.0
    if option.kernel == "fused_uvm":
        return 0.0
    return option.cache_ratio ** (1 - table.locality)


def shard_memory(rows: float, dim: int, ids: float, table: TableSpec, option: Option, world: World):
    """(HBM, host) bytes of one shard (module docstring)."""
    e = table.element_bytes
    weights = rows * (dim * e + state_row_bytes(table, dim, world.optimizer))
    buffers = ids * ID_BYTES + 2 * world.batch_per_rank * world.size * dim * e
    if option.kernel == "fused":
        return weights + buffers, 0.0
    if option.kernel == "fused_uvm":
        return buffers, weights
    cached = math.ceil(rows * option.cache_ratio)
    return cached * (dim * e + CACHE_INDEX_BYTES) + buffers, weights


def price(table: TableSpec, option: Option, world: World) -> OptionCost:
    """The prices of ``option`` for ``table`` on ``world`` (formulas in the module docstring)."""
    kind = option.sharding_type
    if kind not in SHARDING_TYPES:
        raise TableSpecError(f"sharding type {kind!r} unknown; one of {SHARDING_TYPES}")
    if kind == "data_parallel":
        return _price_data_parallel(table, option, world)
    k = option.column_shards
    dim = math.ceil(table.dim / k)  # even by construction (candidate_options); else padded
    ids_global = world.batch_per_rank * world.size * table.pooling_factor
    out = world.batch_per_rank * world.size * dim * table.element_bytes
    every = world.mesh.axis_names
    if kind in ("table_wise", "column_wise"):
        placement, groups, n = "rank", k, 1
        comm = 2 * bandwidth_time("all-to-all", out, every, world)
    elif kind == "row_wise":
        placement, groups, n = "all", 1, world.size
        comm = _reduce_scatter_pair(out, every, world)
    else:  # table_row_wise, grid
        placement, groups, n = "node", k, world.local
        comm = _reduce_scatter_pair(out, ("local",), world)
        across = tuple(a for a in every if a != "local")
        comm += 2 * bandwidth_time("all-to-all", out / n, across, world)
    ids = ids_global / n
    input_dist = bandwidth_time("all-to-all", ids * ID_BYTES, every, world)
    lookups = lookup_time(ids, dim, table, option, world)
    hbm, host = shard_memory(math.ceil(table.rows / n), dim, ids, table, option, world)
    parts = (("lookup", lookups), ("input_dist", input_dist), ("output_dist", comm))
    return OptionCost(option, placement, groups, lookups + input_dist + comm, hbm, host, parts)


def _reduce_scatter_pair(out: float, axes: tuple[str, ...], world: World) -> float:
    """Forward reduce-scatter of partial pooled outputs, backward all-gather of their grads."""
    n = world.mesh.group_size(axes)
    scattered = out / n
    return bandwidth_time("reduce-scatter", scattered, axes, world) + bandwidth_time(
        "all-gather", out, axes, world
    )


def _price_data_parallel(table: TableSpec, option: Option, world: World) -> OptionCost:
    ids = world.batch_per_rank * table.pooling_factor
    lookups = lookup_time(ids, table.dim, table, option, world)
    grad = table.rows * table.dim * table.element_bytes
    allreduce = bandwidth_time("all-reduce", grad, world.mesh.axis_names, world)
    hbm, host = shard_memory(table.rows, table.dim, ids, table, option, world)
    parts = (("lookup", lookups), ("grad_allreduce", allreduce))
    return OptionCost(option, "all", 1, lookups + allreduce, hbm + grad, host, parts)


CACHE_RATIOS = (0.05, 0.1, 0.2, 0.5)


def candidate_options(table: TableSpec, world: World) -> list[Option]:
    """Every option worth pricing: sharding types x kernels x cache ratios x column shards.

    Column shards are the powers of two up to ``W`` (``grid``: up to the node count) that divide
    the dim (TorchRec refuses uneven column splits) and leave each shard at least 4 wide.
    """
    kernels = [("fused", 1.0), ("fused_uvm", 0.0)] + [
        ("fused_uvm_caching", r) for r in CACHE_RATIOS
    ]
    out = [Option("data_parallel")]
    types = ["table_wise", "row_wise"]
    if world.nodes > 1:
        types.append("table_row_wise")
    for kind in types:
        out += [Option(kind, kernel, ratio) for kernel, ratio in kernels]
    for kind, limit in (("column_wise", world.size), ("grid", world.nodes)):
        k = 2
        while k <= limit and table.dim // k >= 4 and table.dim % k == 0:
            out += [Option(kind, kernel, ratio, k) for kernel, ratio in kernels]
            k *= 2
    return out
