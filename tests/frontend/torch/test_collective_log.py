"""``simulate.CollectiveLog`` names a collective's group by this mesh's axes, whatever mesh made
the group (DTensor reuses an earlier mesh's process groups for equal-ranked ones)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from shardplan.frontend.torch import simulate
from torch.distributed.device_mesh import init_device_mesh

pytestmark = pytest.mark.torch


def test_a_reused_group_is_named_by_this_meshs_axes() -> None:
    """A ``{"tp": 4}`` mesh's group spans ranks 0-3, as the flattened ``dp x tp`` group of a
    later ``{"dp": 2, "tp": 2}`` mesh does: a reduction run on the old group is over (dp, tp)
    of the new mesh, not over its ``tp`` (the one-process suite's order made the gradient
    reductions of ``test_emit``'s throughput plan read as ``reduce-scatter[tp]``)."""
    simulate.simulated_world(4)
    old = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    simulate.CollectiveLog(old)  # registers the old mesh's group names, as a run on it does
    new = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    log = simulate.CollectiveLog(new)
    x = torch.ones(8)
    with log:
        funcol.all_reduce(x, "sum", old.get_group(0).group_name).wait()
        funcol.all_reduce(x, "sum", new.get_group(1).group_name).wait()
    assert dict(log.counts) == {("all-reduce", ("dp", "tp"), 32): 1,
                                ("all-reduce", ("tp",), 32): 1}  # fmt: skip
