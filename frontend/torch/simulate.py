"""Run applied plans on simulated ranks in one process, and compare collectives with the plan.

``simulated_world`` starts a fake process group; ``local_ranks`` runs DTensor code on every
rank at once (``LocalTensorMode``: real numerics); ``observed_collectives`` counts what a step
issued (``CommDebugMode``), ``predicted_collectives`` what the plan's reshards issue when
DTensor performs them and ``planned_collectives`` the plan's own (cost-model) collectives. The
private torch APIs this needs are each isolated in one function below.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode  # documented home of dispatch modes

from ...ir import Sharding
from ...solver.plan import Plan, Reshard
from .emit import Placements, context_of, placements_of

# CommDebugMode op names -> the plan's collective kinds.
_KINDS = {
    "all_reduce": "all-reduce", "allreduce_": "all-reduce",
    "all_gather_into_tensor": "all-gather", "_allgather_base_": "all-gather",
    "allgather_": "all-gather", "all_gather": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter", "_reduce_scatter_base_": "reduce-scatter",
    "reduce_scatter_": "reduce-scatter", "all_to_all_single": "all-to-all",
    "alltoall_base_": "all-to-all", "all_to_all": "all-to-all",
    "shard_dim_alltoall": "all-to-all",  # DTensor's Shard(i) -> Shard(j) on one mesh dim
}  # fmt: skip


def simulated_world(world_size: int) -> None:
    """A fake process group of ``world_size`` ranks (collectives are no-ops), once per process."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            dist.destroy_process_group()
        else:
            return
    # Private: FakeStore registers the "fake" backend; there is no public equivalent.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


@contextlib.contextmanager
def local_ranks(world_size: int) -> Iterator[None]:
    """Every rank simulated at once, with exact numerics (DTensor/TP; not FSDP2)."""
    # Private: LocalTensorMode is the only single-process way to get per-rank DTensor values.
    from torch.distributed._local_tensor import LocalTensorMode

    with LocalTensorMode(frozenset(range(world_size))):
        yield


def rank0(tensor: Any) -> torch.Tensor:
    """The global value of a (local-)DTensor as rank 0 sees it, as a plain tensor."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    local = getattr(tensor, "_local_tensors", None)  # LocalTensor: one tensor per rank
    if local is not None:
        tensor = local[min(local)]
    return tensor.detach()


def observed_collectives(mode: CommDebugMode) -> Counter[str]:
    """``{kind: count}`` of the collectives recorded by a CommDebugMode."""
    counts: Counter[str] = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).rsplit(".", 1)[-1]
        counts[_KINDS.get(name, name)] += n
    return counts


def planned_reshards(plan: Plan) -> list[Reshard]:
    """The reshards one applied forward + backward performs, in graph order.

    Every reshard into a forward or backward op (``follow_plan`` performs each at its op), plus
    each gradient's move into the optimizer, once per gradient and layout (``apply``'s gradient
    hook moves it once; every optimizer op then reads that copy).
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
            seen.add((reshard.value, reshard.dst))
        result.append(reshard)
    return result


def planned_collectives(plan: Plan) -> Counter[str]:
    """``{kind: count}`` of the plan's own collectives (its cost model's) for those reshards.

    A collective over several mesh axes counts once per axis. DTensor carries some reshards
    out differently (docs/torch.md, "Collectives"): compare run-time counts with
    ``predicted_collectives``.
    """
    counts: Counter[str] = Counter()
    for reshard in planned_reshards(plan):
        for collective in reshard.collectives:
            counts[collective.kind] += len(collective.axes)
    return counts


Collective = tuple[str, tuple[str, ...], int]
"""(kind, mesh axes in mesh order, bytes of the result on one device): the cost model's terms."""


def planned_collective_list(plan: Plan) -> Counter[Collective]:
    """The plan's own collectives (its cost model's, one per multi-axis group) for the reshards
    one applied forward + backward performs, as ``{(kind, axes, bytes): count}``."""
    counts: Counter[Collective] = Counter()
    for reshard in planned_reshards(plan):
        for c in reshard.collectives:
            counts[(c.kind, tuple(c.axes), c.bytes)] += reshard.count
    return counts


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
        self.axes = axis_groups(device_mesh)
        self.counts: Counter[Collective] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        namespace = getattr(func, "namespace", "")
        kind = _FUNCTIONAL.get(getattr(func, "__name__", "").split(".")[0])
        if kind is not None and namespace in ("_c10d_functional", "_dtensor"):
            self._record(kind, args)
        return out

    def _record(self, kind: str, args: tuple) -> None:
        tensor, group = args[0], args[-1]
        size = tensor.numel() * tensor.element_size()
        n = args[-2] if kind in ("all-gather", "reduce-scatter") else 1
        size = size * n if kind == "all-gather" else size // n
        self.counts[(kind, self.axes.get(group, (str(group),)), size)] += 1


_FUNCTIONAL = {
    "all_gather_into_tensor": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter",
    "all_reduce": "all-reduce",
    "all_to_all_single": "all-to-all",
    "shard_dim_alltoall": "all-to-all",  # DTensor's Shard(i) -> Shard(j) on one group
}


def axis_groups(device_mesh: DeviceMesh) -> dict[str, tuple[str, ...]]:
    """Process group name -> the mesh axes it spans (each dimension, and flattened groups)."""
    from .emit import flattened_meshes

    names = tuple(device_mesh.mesh_dim_names or ())
    groups = {device_mesh.get_group(i).group_name: (names[i],) for i in range(device_mesh.ndim)}
    for axes, flat in flattened_meshes(device_mesh).items():
        groups[flat.get_group().group_name] = axes
    return groups


def collective_listing(counts: Counter[Collective]) -> str:
    return (
        "\n".join(
            f"  {n} x {kind}[{','.join(axes)}] {size} B"
            for (kind, axes, size), n in sorted(counts.items())
        )
        or "  none"
    )


def predicted_collectives(plan: Plan, device_mesh: DeviceMesh) -> Counter[str]:
    """``{kind: count}`` of the planned reshards as DTensor performs them.

    Each planned reshard (value, source layout, target layout) is replayed alone with
    ``DTensor.redistribute`` under ``CommDebugMode`` on ``device_mesh`` (a simulated world:
    nothing is communicated), so the kinds are DTensor's per-mesh-dimension collectives
    (an all-to-all over two axes may be an all-gather plus an all-to-all). Call it inside
    ``local_ranks``, as the step it is compared with: on a CPU mesh outside it, gloo's missing
    all-to-all makes DTensor fall back to all-gathers.
    """
    types = {v.name: v.type for v in plan.graph.values()}
    counts: Counter[str] = Counter()
    done: dict[tuple, Counter[str]] = {}
    for reshard in planned_reshards(plan):
        key = (
            placements_of(reshard.src, plan.mesh),
            placements_of(reshard.dst, plan.mesh),
            types[reshard.value].shape,
        )
        if key not in done:
            done[key] = _dtensor_reshard(*key, device_mesh)
        counts += done[key]
    return counts


def _dtensor_reshard(
    src: Placements, dst: Placements, shape: tuple[int, ...], mesh: DeviceMesh
) -> Counter[str]:
    replicated = [Replicate()] * mesh.ndim
    full = distribute_tensor(torch.zeros(shape), mesh, replicated, src_data_rank=None)
    start = full.redistribute(
        placements=[Replicate() if isinstance(p, Partial) else p for p in src]
    )
    if start.placements != src:  # a pending sum: same local buffer, reinterpreted
        start = DTensor.from_local(start.to_local(), mesh, src, run_check=False)
    with CommDebugMode() as comm:
        start.redistribute(placements=dst)
    return observed_collectives(comm)


def listing(counts: Counter[str]) -> str:
    return ", ".join(f"{k}: {counts[k]}" for k in sorted(counts)) or "none"
