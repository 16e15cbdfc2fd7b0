"""The dense part of a recommendation model (bottom/top MLPs, interaction) priced as DDP or FSDP.

Compute: ``3 * flops_per_sample * B / (peak * compute_efficiency)`` (forward, plus a backward
of twice the forward: ref §4 MAD-Max "backward = 2x forward"), with ``flops_per_sample``
defaulting to ``2 * params`` (an MLP's multiply-adds). Memory: parameters, gradients and the
optimizer's state (Adam: two fp32 moments per parameter, 8 B) plus activations
(``activation_bytes_per_sample * B``). DDP keeps all of it on every rank and all-reduces the
gradients, overlapped with the backward (exposed: ``max(0, AR - backward)``). FSDP shards
parameters, gradients and state over the ranks, holds two unsharded layers (prefetch), and pays
an all-gather in forward, one in backward and a reduce-scatter of gradients, hidden under the
compute except the first layer's gather (exposed: ``max(comm / layers, comm - compute)``).
Collectives are priced by ``collectives.collective_time`` over all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.ir.errors import ArgumentError, TableSpecError

from .collectives import collective_time
from .embedding import DTYPE_BYTES, World

DENSE_MODES = ("ddp", "fsdp")
ADAM_STATE_BYTES = 8


@dataclass(frozen=True, slots=True)
class DenseSpec:
    """The dense layers of a recommendation model, by size.

    Invariants: param_bytes >= 0, layers >= 1; ``flops_per_sample`` 0 means ``2 * params``.

    Example: ``DenseSpec(param_bytes=1.2e9)`` (MAD-Max DLRM-A's 1.2 GB dense part, fp32).
    """

    param_bytes: float
    flops_per_sample: float = 0.0
    activation_bytes_per_sample: float = 0.0
    dtype: str = "f32"
    compute_dtype: str = "bf16"
    layers: int = 4
    optimizer_state_bytes: int = ADAM_STATE_BYTES

    def __post_init__(self) -> None:
        if self.param_bytes < 0 or self.layers < 1 or self.dtype not in DTYPE_BYTES:
            raise TableSpecError(
                f"DenseSpec(param_bytes={self.param_bytes}, layers={self.layers}, "
                f"dtype={self.dtype!r}): need param_bytes >= 0, layers >= 1 and a dtype in "
                f"{sorted(DTYPE_BYTES)}"
            )

    @property
    def params(self) -> float:
        return self.param_bytes / DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class DenseCost:
    mode: str
    time: float
    compute: float
    exposed_comm: float
    hbm: float


def price_dense(dense: DenseSpec | None, mode: str, world: World) -> DenseCost:
    """Seconds per iteration and HBM bytes per rank of the dense part under ``mode``."""
    if dense is None or dense.param_bytes == 0:
        return DenseCost(mode, 0.0, 0.0, 0.0, 0.0)
    cluster = world.cluster
    flops = dense.flops_per_sample or 2 * dense.params
    rate = cluster.peak(dense.compute_dtype) * cluster.compute_efficiency
    forward = flops * world.batch_per_rank / rate
    compute = 3 * forward
    full = dense.param_bytes * 2 + dense.params * dense.optimizer_state_bytes
    activations = dense.activation_bytes_per_sample * world.batch_per_rank
    axes = world.mesh.axis_names
    mesh = world.mesh
    if mode == "ddp":
        comm = collective_time("all-reduce", dense.param_bytes, axes, mesh, cluster)
        exposed = max(0.0, comm - 2 * forward)
        hbm = full + activations
    elif mode == "fsdp":
        gather = collective_time("all-gather", dense.param_bytes, axes, mesh, cluster)
        scatter = collective_time(
            "reduce-scatter", dense.param_bytes / world.size, axes, mesh, cluster
        )
        comm = 2 * gather + scatter
        exposed = max(comm / dense.layers, comm - compute)
        hbm = full / world.size + 2 * dense.param_bytes / dense.layers + activations
    else:
        raise ArgumentError(f"dense mode {mode!r} unknown; one of {DENSE_MODES}")
    return DenseCost(mode, compute + exposed, compute, exposed, hbm)
