"""A max pool's indices on a row slab (``frontend/torch/pool_local.py``): the slab's positions
as the whole input's and back, against the whole call's indices."""

from __future__ import annotations

import pytest
import torch
from shardplan.frontend.torch.conv import disjoint_windows
from shardplan.frontend.torch.pool_local import to_global, to_slab

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("dim", [2, 3])
def test_slab_indices_are_the_whole_inputs_positions(dim: int) -> None:
    """Rows (or columns) of an 8x12 map in 2 slabs, 2x2 windows: each slab's kernel indices,
    made global, equal the whole call's over that slab's output rows; ``to_slab`` inverts."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 12)
    _, whole = torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    for k, slab in enumerate(x.chunk(2, dim=dim)):
        _, local = torch.ops.aten.max_pool2d_with_indices(slab.contiguous(), [2, 2], [2, 2])
        offsets = [0, 0]
        offsets[dim - 2] = k * slab.shape[dim]
        made = to_global(local, slab.shape[2:], x.shape[2:], offsets)
        assert torch.equal(made, whole.chunk(2, dim=dim)[k])
        assert torch.equal(to_slab(made, slab.shape[2:], x.shape[2:], offsets), local)
        assert not torch.equal(made, local) or k == 0


@pytest.mark.parametrize(
    ("kind", "args", "disjoint"),
    [
        ("max_pool", (None, [2, 2]), True),  # stride defaults to the kernel
        ("max_pool", (None, [2, 2], [2, 2], [0, 0], [1, 1], False), True),
        ("max_pool", (None, [3, 3], [2, 2], [1, 1]), False),  # ResNet's: overlapping
        ("max_pool", (None, [2, 2], [2, 2], [0, 0], [2, 2]), False),  # dilated
        ("avg_pool", (None, [2, 2], [2, 2], [0, 0], False, True, None), True),
        ("avg_pool_backward", (None, None, [2, 2], [2, 2], [1, 1], False, True, None), False),
        ("max_pool_backward", (None, None, [2, 2], [2, 2], [0, 0], [1, 1], False, None), True),
        ("upsample", (None, [2, 2]), False),
    ],
)
def test_disjoint_windows_reads_the_aten_arguments(kind: str, args: tuple, disjoint: bool):
    assert disjoint_windows(kind, args, 2) is disjoint
