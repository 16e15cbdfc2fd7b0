"""``follow_plan``'s reshard runs the cost model's collective-permutes (8 simulated ranks).

Each case is a reshard whose priced walk (``costmodel.reshard``) contains a collective-permute:
the functional collectives run equal the priced ones (kind, mesh axes, bytes), the result holds
the same global tensor at the target placements, and the gradient that flows back through the
permute (its backward is the inverse permute) equals the plain one.
"""

from __future__ import annotations

from collections import Counter

import pytest
import shardplan as sp
import torch
from shardplan.costmodel.reshard import reshard as priced
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.reshard import reshard, sharding_of
from shardplan.ir import TensorType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

pytestmark = pytest.mark.torch

AXES = {"dp": 2, "ep": 2, "tp": 2}
S0, S1, R = Shard(0), Shard(1), Replicate()
CASES: dict[str, tuple[tuple[Placement, ...], tuple[Placement, ...], list[str]]] = {
    # token ids of the EP-pinned (2, 2, 2) Mixtral: a permute puts (ep, tp) first, then dp is
    # gathered (the permuted layout (ep, tp, dp) has no DTensor placements)
    "ids-(dp,ep,tp)->(ep,tp)": ((S0, S0, S0), (R, S0, S0), ["collective-permute", "all-gather"]),
    "dp->ep": ((S0, R, R), (R, S0, R), ["collective-permute"]),
    "swap-dims": ((S0, S1, R), (S1, S0, R), ["collective-permute"]),
    "slice-then-permute": ((R, R, S0), (S0, R, R), ["collective-permute"]),
}


@pytest.fixture(scope="module")
def device_mesh():  # type: ignore[no-untyped-def]
    simulate.simulated_world(8)
    return init_device_mesh("cpu", tuple(AXES.values()), mesh_dim_names=tuple(AXES))


@pytest.mark.parametrize("case", list(CASES))
def test_reshard_runs_the_priced_permute(device_mesh, case: str) -> None:  # type: ignore[no-untyped-def]
    src, dst, kinds = CASES[case]
    mesh = sp.Mesh(AXES, cluster="cpu-test")
    whole_type = TensorType((8, 16), "f32")
    want = Counter(
        (c.kind, tuple(c.axes), c.bytes)
        for c in priced(sharding_of(src, mesh, 2), sharding_of(dst, mesh, 2), whole_type, mesh)
    )
    assert sorted({k for k, _, _ in want}) == sorted(set(kinds)), want  # the case is a permute
    torch.manual_seed(0)
    whole, weight = torch.randn(8, 16), torch.randn(8, 16)
    with simulate.local_ranks(8):
        x = distribute_tensor(whole, device_mesh, list(src)).detach().requires_grad_(True)
        log = simulate.CollectiveLog(device_mesh)
        with log:
            moved, as_priced = reshard(x, dst, mesh)
        assert as_priced
        assert tuple(moved.placements) == dst
        assert log.counts == want, simulate.collective_listing(log.counts)
        torch.testing.assert_close(simulate.rank0(moved), whole)
        (moved.full_tensor() * weight).sum().backward()  # back through the inverse permute
        torch.testing.assert_close(simulate.rank0(x.grad), weight)
