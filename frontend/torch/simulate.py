"""Run applied plans on simulated ranks in one process, and compare collectives with the plan.

``simulated_world`` starts a fake process group; ``local_ranks`` runs DTensor code on every
rank at once (``LocalTensorMode``: real numerics); ``observed_collectives`` counts what a step
issued (``CommDebugMode``) and ``predicted_collectives`` what the plan says it will issue. The
private torch APIs this needs are each isolated in one function below.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from ...solver.plan import Plan
from .emit import context_of

# CommDebugMode op names -> the plan's collective kinds.
_KINDS = {
    "all_reduce": "all-reduce", "allreduce_": "all-reduce",
    "all_gather_into_tensor": "all-gather", "_allgather_base_": "all-gather",
    "allgather_": "all-gather", "all_gather": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter", "_reduce_scatter_base_": "reduce-scatter",
    "reduce_scatter_": "reduce-scatter", "all_to_all_single": "all-to-all",
    "alltoall_base_": "all-to-all", "all_to_all": "all-to-all",
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


def predicted_collectives(plan: Plan) -> Counter[str]:
    """``{kind: count}`` the plan predicts for forward + backward + gradient reduction.

    Counts every reshard into a non-optimizer op, plus reshards of gradients into the
    optimizer (``apply`` performs those right after backward). A collective over several mesh
    axes counts once per axis, as DTensor issues one collective per mesh dimension.
    """
    context = context_of(plan)
    grads = set(context.grad_values.values())
    counts: Counter[str] = Counter()
    for reshard in plan.reshards:
        kind, _, rest = reshard.consumer.partition(":")
        if kind != "op":
            continue
        op = plan.graph.ops[int(rest.split(":")[0])]
        if op.origin.module == "optimizer" and reshard.value not in grads:
            continue
        for collective in reshard.collectives:
            counts[collective.kind] += len(collective.axes)
    return counts


def listing(counts: Counter[str]) -> str:
    return ", ".join(f"{k}: {counts[k]}" for k in sorted(counts)) or "none"
