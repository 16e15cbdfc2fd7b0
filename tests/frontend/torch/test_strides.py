"""Views of DTensors whose local shard is laid out unlike their strides (``strides.py``).

DTensor's all-gather returns a contiguous shard while the DTensor keeps a transpose's strides;
the transpose back then claims contiguous strides over a transposed shard, and ``view`` -
allowed by the strides - failed on the shard with torch's raw "view size is not compatible
with input tensor's size and stride" (HF Swin's window partition in backward, T5 FSDP on
(2, 2, 2)). The view runs on a contiguous copy of the shard: the eager values, no collective.
"""

from __future__ import annotations

import pytest
import torch
from shardplan.frontend.torch import simulate, strides
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

pytestmark = pytest.mark.torch

WORLD = 4


def _transposed_back(x: torch.Tensor, mesh) -> DTensor:  # type: ignore[no-untyped-def]
    """``x`` as a DTensor with contiguous strides over a transposed local shard: ``x.t()`` split
    on its columns, gathered (a contiguous shard, the transpose's strides), transposed back."""
    split = _to(x, mesh, Shard(0)).t()
    gathered = split.redistribute(mesh, [Replicate()])
    back = gathered.t()
    assert back.is_contiguous()
    assert not back.to_local().is_contiguous()
    return back


def _to(x: torch.Tensor, mesh, placement) -> DTensor:  # type: ignore[no-untyped-def]
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [placement])
    return distribute_tensor(x, mesh, [placement])


def _world():  # type: ignore[no-untyped-def]
    simulate.simulated_world(WORLD)
    return init_device_mesh("cpu", (WORLD,))


def test_view_of_a_transposed_shard_is_the_eager_view() -> None:
    """Forward: the view, and a split of the viewed dim, match the plain tensor's."""
    mesh = _world()
    x = torch.arange(32.0).reshape(8, 4)
    strides.ensure_view_handler()
    with simulate.local_ranks(WORLD):
        back = _transposed_back(x, mesh)
        flat = back.view(32)
        windows = back.view(2, 4, 4).transpose(0, 1).contiguous().view(4, 8)
        got = simulate.rank0(flat.full_tensor()), simulate.rank0(windows.full_tensor())
    torch.testing.assert_close(got[0], x.view(32))
    torch.testing.assert_close(got[1], x.view(2, 4, 4).transpose(0, 1).reshape(4, 8))


def test_backward_of_a_view_of_a_transposed_shard() -> None:
    """Backward: ``leaf.view(4, 8).t()`` split on its columns, transposed back; its gradient
    reaches the split as a transpose, is gathered (a contiguous shard, the transpose's
    strides) and transposed back, and autograd's view of it to ``leaf``'s shape is eager's."""
    mesh = _world()
    weight = torch.linspace(-1.0, 1.0, 32).reshape(4, 8)
    strides.ensure_view_handler()
    with simulate.local_ranks(WORLD):
        leaf = distribute_tensor(torch.ones(32), mesh, [Replicate()]).requires_grad_()
        split = leaf.view(4, 8).t().redistribute(mesh, [Shard(1)])
        (split.t() * distribute_tensor(weight, mesh, [Shard(0)])).sum().backward()
        grad = simulate.rank0(leaf.grad.full_tensor())
    torch.testing.assert_close(grad, weight.reshape(32))


def test_a_failing_view_of_a_contiguous_shard_still_raises() -> None:
    """Only a view of a non-contiguous shard is retried: a wrong shape stays torch's error."""
    mesh = _world()
    strides.ensure_view_handler()
    with simulate.local_ranks(WORLD):
        whole = distribute_tensor(torch.zeros(8, 4), mesh, [Replicate()])
        with pytest.raises(RuntimeError, match="invalid for input of size"):
            whole.view(5, 7)
