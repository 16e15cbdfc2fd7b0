"""Run applied plans on simulated ranks in one process, and compare collectives with the plan.

``simulated_world`` starts a fake process group; ``local_ranks`` runs DTensor code on every
rank at once (``LocalTensorMode``: real numerics); ``CollectiveLog`` records what a step issued
as (kind, mesh axes, bytes) and ``planned_collective_list`` gives the plan's own (cost-model)
collectives in the same terms. The private torch APIs this needs are each isolated in one
function below.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode  # documented home of dispatch modes

from ...costmodel.collectives import Collective as CostCollective
from ...costmodel.conv import HALO_KINDS, halo_collectives
from ...ir import Sharding
from ...solver.plan import Plan, Reshard
from ...solver.table_wise import table_exchanges
from .emit import consumed_layout, context_of
from .reshard import per_rank

SIMULATED_RANKS = 64
"""Ranks of the one fake world a process makes: any mesh up to this size is a sub-mesh of it."""


def simulated_world(world_size: int) -> None:
    """A fake process group of at least ``world_size`` ranks (collectives are no-ops).

    Made once per process, with ``max(world_size, SIMULATED_RANKS)`` ranks, and never
    destroyed for a smaller mesh: a ``DeviceMesh`` of fewer ranks is a sub-mesh of it (its
    groups are new groups of the world). Destroying the world to resize it (as this once did)
    left every mesh built on the old one pointing at deleted process groups, and DTensor
    caches sharding decisions per *equal* mesh, so a later run on a new, equal mesh resolved
    the old groups: "Could not resolve the process group registered under the name 23" when
    tests of several world sizes ran in one process (``SHARDPLAN_TEST_WORKERS=0``).
    """
    if dist.is_initialized():
        if dist.get_world_size() >= world_size:
            return
        dist.destroy_process_group()  # only for a mesh larger than SIMULATED_RANKS
    # Private: FakeStore registers the "fake" backend; there is no public equivalent.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    size = max(world_size, SIMULATED_RANKS)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)


@contextlib.contextmanager
def local_ranks(world_size: int) -> Iterator[None]:
    """Every rank simulated at once, with exact numerics (DTensor/TP; not FSDP2)."""
    # Private: LocalTensorMode is the only single-process way to get per-rank DTensor values.
    from torch.distributed._local_tensor import LocalTensorMode

    with LocalTensorMode(frozenset(range(world_size))):
        yield


def own_copies(module: torch.nn.Module) -> torch.nn.Module:
    """Give every simulated rank its own copy of each parameter that has one shared tensor.

    ``distribute_tensor`` of a plain tensor to ``Replicate()`` (``src_data_rank=None``) keeps
    that one tensor as every rank's local shard. An in-place optimizer update with per-rank
    operands (a gradient moved by collectives is per rank) then runs once per simulated rank
    on the shared tensor: the replicated parameter moved ``world_size`` times per step. Each
    rank gets a clone (in place, keeping the ``nn.Parameter`` objects). Call inside
    ``local_ranks``; a no-op outside it.
    """
    # Private: LocalTensor/rank_map are the only way to hold per-rank values in one process.
    from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode, rank_map

    if enabled_local_tensor_mode() is None:
        return module
    for param in module.parameters():
        if not isinstance(param, DTensor) or isinstance(param._local_tensor, LocalTensor):
            continue
        shared = param._local_tensor.detach()
        with torch.no_grad():
            param._local_tensor = rank_map(lambda rank, t=shared: t.clone())
    return module


def rank0(tensor: Any) -> torch.Tensor:
    """The global value of a (local-)DTensor as rank 0 sees it, as a plain tensor."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    local = getattr(tensor, "_local_tensors", None)  # LocalTensor: one tensor per rank
    if local is not None:
        tensor = local[min(local)]
    return tensor.detach()


def local_on(tensor: Any, rank: int) -> torch.Tensor:
    """A (local-)DTensor's local tensor on one simulated rank, as a plain tensor (a table-wise
    table's gradient: whole on its owner, zero elsewhere, under a replicated layout)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    local = getattr(tensor, "_local_tensors", None)  # LocalTensor: one tensor per rank
    return (local[rank] if local is not None else tensor).detach()


def planned_reshards(plan: Plan) -> list[Reshard]:
    """The reshards one applied forward + backward performs, in graph order.

    Every reshard into a forward or backward op (``follow_plan`` performs each at its op), plus
    each gradient's move to the layout its first optimizer op reads (``apply``'s gradient hook
    moves it there once; the optimizer step, ``torch.optim``'s, is not part of the step).
    """
    context = context_of(plan)
    grads = set(context.grad_values.values())
    result: list[Reshard] = []
    seen: set[tuple[str, Sharding]] = set()
    for reshard in plan.reshards:
        kind, _, rest = reshard.consumer.partition(":")
        if kind != "op":
            continue
        if plan.graph.ops[int(rest.split(":")[0])].origin.module == "optimizer":
            if reshard.value not in grads or (reshard.value, reshard.dst) in seen:
                continue
            if reshard.dst != consumed_layout(plan, reshard.value, "optimizer"):
                continue  # the hook moves a gradient once; other reads are the optimizer's
            seen.add((reshard.value, reshard.dst))
        result.append(reshard)
    return result


Collective = tuple[str, tuple[str, ...], int]
"""(kind, mesh axes in mesh order, bytes of the result on one device): the cost model's terms."""


def planned_collective_list(plan: Plan) -> Counter[Collective]:
    """The plan's own collectives (its cost model's, one per multi-axis group) for the reshards
    one applied forward + backward performs, its convolutions' halo exchanges and its
    table-wise lookups' scatters and gathers, as
    ``{(kind, axes, bytes): count}``."""
    counts: Counter[Collective] = Counter()
    for reshard in planned_reshards(plan):
        for c in reshard.collectives:
            counts[(c.kind, tuple(c.axes), c.bytes)] += reshard.count
    for c in planned_halos(plan):
        counts[(c.kind, tuple(c.axes), c.bytes)] += 1
    for _, pair in table_exchanges(plan):  # table-wise lookups: priced inside the op
        for c in pair:
            counts[(c.kind, tuple(c.axes), c.bytes)] += 1
    return counts


def planned_halos(plan: Plan, saved_input: bool = False) -> list[CostCollective]:
    """The halo exchanges (collective-permutes) of the plan's row-split convolutions, priced
    inside their ops rather than as reshards (``costmodel.conv.halo_collectives``;
    ``saved_input``: ``plan.apply``'s backward, which keeps the forward's extended slab)."""
    found: list[CostCollective] = []
    for i, op in enumerate(plan.graph.ops):
        if op.kind in HALO_KINDS:
            operands = [plan.operand_shardings[(i, j)] for j in range(len(op.operands))]
            found += halo_collectives(op, operands, plan.mesh, saved_input)
    return found


class CollectiveLog(TorchDispatchMode):
    """Records every functional collective a run issues as ``(kind, axes, bytes)``.

    DTensor operands are left to DTensor (``NotImplemented``), so the log sees the collectives
    its redistributions desugar into. A group is named by the mesh axes it spans: one mesh
    dimension, or a flattened group of several (``emit.flatten_mesh``). Bytes are the result's
    on one device, as the cost model counts them (an all-gather's gathered tensor, a
    reduce-scatter's shard, an all-reduce's or all-to-all's local tensor).
    """

    def __init__(self, device_mesh: DeviceMesh) -> None:
        super().__init__()
        self.own = mesh_groups(device_mesh)
        self.axes = axis_groups(device_mesh)
        self.by_ranks = {_group_ranks(name): axes for name, axes in self.own.items()}
        self.counts: Counter[Collective] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        namespace = getattr(func, "namespace", "")
        kind = _FUNCTIONAL.get(getattr(func, "__name__", "").split(".")[0])
        if kind is not None and namespace in ("_c10d_functional", "_dtensor"):
            self._record(kind, args, out)
        return out

    def _record(self, kind: str, args: tuple, out: Any) -> None:
        tensor, group = args[0], args[-1]
        if kind == "all-to-all" and isinstance(args[2], (list, tuple)) and _one_peer(*args[1:3]):
            kind = "collective-permute"  # each rank sends its whole block to one partner
        size = tensor.numel() * tensor.element_size()
        if kind == "all-to-all":  # a table-wise scatter or gather: the owner's block
            size = _largest(size, out.numel() * out.element_size())
        n = args[-2] if kind in ("all-gather", "reduce-scatter") else 1
        size = size * n if kind == "all-gather" else size // n
        self.counts[(kind, self._axes_of(group), size)] += 1

    def _axes_of(self, group: str) -> tuple[str, ...]:
        """The mesh axes of a group: one of this mesh's by name (a size-1 axis makes two of
        them equal-ranked), else by its ranks among them, since DTensor reuses an earlier
        mesh's groups for equal-ranked ones (a ``{"tp": 4}`` mesh made by an earlier test,
        then a ``{"dp": 2, "tp": 2}`` one whose flattened ``dp x tp`` reduction runs on the old
        ``tp`` group: by the old name it read as ``tp``), else any earlier mesh's by name."""
        axes = self.own.get(group) or self.by_ranks.get(_group_ranks(group))
        return axes if axes is not None else self.axes.get(group, (str(group),))


_FUNCTIONAL = {
    "all_gather_into_tensor": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter",
    "all_reduce": "all-reduce",
    "all_to_all_single": "all-to-all",
    "shard_dim_alltoall": "all-to-all",  # DTensor's Shard(i) -> Shard(j) on one group
}


def _per_rank_values(value: Any) -> list[int]:
    """Every simulated rank's value of an int that may differ per rank (an all-to-all in which
    only a table's owner sends or receives: ``bags_owned``); a plain int is one value.
    Private: a per-rank int is a ``LocalIntNode`` whose values have no public accessor."""
    local = getattr(getattr(value, "node", None), "_local_ints", None)
    if local is None:
        local = getattr(value, "_local_ints", None)
    return list(local.values()) if local is not None else [int(value)]


def _largest(*sizes: Any) -> int:
    """The largest of byte counts that may differ per simulated rank."""
    return max(v for size in sizes for v in _per_rank_values(size))


def _one_peer(output_splits: Any, input_splits: Any) -> bool:
    """Whether an ``all_to_all_single`` sends everything to one peer and receives everything
    from one on every rank (``reshard``'s collective-permute) rather than a slice to or from
    each (a table-wise gather sends to one peer but its owner receives from every one)."""
    if len(input_splits) < 2:
        return False

    def one(out: list[int], inp: list[int]) -> int:
        return int(sum(1 for s in out if s != 0) == 1 and sum(1 for s in inp if s != 0) == 1)

    return all(v == 1 for v in _per_rank_values(per_rank(one)(list(output_splits),
                                                                 list(input_splits))))  # fmt: skip


def mesh_groups(device_mesh: DeviceMesh) -> dict[str, tuple[str, ...]]:
    """This mesh's process group names -> the mesh axes each spans (each dimension, and the
    flattened groups)."""
    from .emit import flattened_meshes

    names = tuple(device_mesh.mesh_dim_names or ())
    own = {device_mesh.get_group(i).group_name: (names[i],) for i in range(device_mesh.ndim)}
    for axes, flat in flattened_meshes(device_mesh).items():
        own[flat.get_group().group_name] = axes
    return own


def axis_groups(device_mesh: DeviceMesh) -> dict[str, tuple[str, ...]]:
    """Process group name -> mesh axes, for this mesh's groups and every group seen before."""
    _GROUP_AXES.update(mesh_groups(device_mesh))
    return dict(_GROUP_AXES)


def _group_ranks(name: str) -> tuple[int, ...]:
    """The global ranks of the process group registered under ``name``.

    Private: functional collectives name their group by a string; resolving it has no public
    API."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return tuple(dist.get_process_group_ranks(_resolve_process_group(name)))
    except (RuntimeError, ValueError, KeyError):
        return ()


_GROUP_AXES: dict[str, tuple[str, ...]] = {}
"""Every group seen so far: DTensor may reuse an earlier, equal mesh's groups (its caches)."""


def collective_listing(counts: Counter[Collective]) -> str:
    return (
        "\n".join(
            f"  {n} x {kind}[{','.join(axes)}] {size} B"
            for (kind, axes, size), n in sorted(counts.items())
        )
        or "  none"
    )
