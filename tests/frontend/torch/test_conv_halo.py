"""Halo exchanges of a row-split convolution (``frontend/torch/halo.py``) on 2 simulated ranks."""

from __future__ import annotations

import pytest
import torch
from shardplan.costmodel.conv import halo_rows
from shardplan.frontend.torch import halo, simulate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

pytestmark = pytest.mark.torch


def _mesh():  # type: ignore[no-untyped-def]
    simulate.simulated_world(2)
    return init_device_mesh("cpu", (2,), mesh_dim_names=("x",))


@pytest.mark.parametrize(("k", "d", "s", "p"), [(3, 1, 1, 1), (3, 2, 1, 2), (3, 1, 2, 1)])
def test_halo_rows_give_the_unsplit_convolution_and_its_gradients(k, d, s, p) -> None:  # type: ignore[no-untyped-def]
    """Rows split in two: each rank's slab extended by ``halo_rows`` neighbour rows and run
    unpadded gives its output rows; the backward's input gradient folded back gives the
    unsplit one and the weight gradients sum to it."""
    torch.manual_seed(0)
    x = torch.randn(1, 4, 16, 12, dtype=torch.float64)
    w = torch.randn(6, 4, k, k, dtype=torch.float64)
    geo = ([s, s], [p, p], [d, d], False, [0, 0], 1)
    y = torch.ops.aten.convolution(x, w, None, *geo)
    g = torch.randn_like(y)
    gi, gw, _ = torch.ops.aten.convolution_backward(g, x, w, None, *geo, [True, True, False])
    lo, hi = halo_rows(k, d, s, p)
    mesh = _mesh()
    unpadded = ([s, s], [0, p], [d, d], False, [0, 0], 1)
    with simulate.local_ranks(2):
        xd, gd = distribute_tensor(x, mesh, [Shard(2)]), distribute_tensor(g, mesh, [Shard(2)])
        ext = halo.extend(xd.to_local(), 2, lo, hi, mesh, 0)
        out = torch.ops.aten.convolution(ext, w, None, *unpadded)
        grads = torch.ops.aten.convolution_backward(gd.to_local(), ext, w, None, *unpadded,
                                                    [True, True, False])  # fmt: skip
        local_gi = halo.fold_back(grads[0], 2, lo, hi, mesh, 0)
        got_y = DTensor.from_local(out, mesh, [Shard(2)], run_check=False).full_tensor()
        got_gi = DTensor.from_local(local_gi, mesh, [Shard(2)], run_check=False).full_tensor()
        got_gw = DTensor.from_local(grads[1], mesh, [Partial()], run_check=False).full_tensor()
        got = [simulate.rank0(t) for t in (got_y, got_gi, got_gw)]
    for a, b in zip(got, (y, gi, gw), strict=True):
        torch.testing.assert_close(a, b)
