"""Max and average pooling on row slabs (``ir.conv.windowed``'s disjoint-window split).

A pool whose every window lies inside its own stride step (kernel <= stride, no padding, no
dilation) may split its window dims at multiples of the stride: each rank pools its own slab
of rows and nothing moves. Two things differ from the whole call:

* a max pool's indices name positions in the rank's slab; the IR value is the whole input's
  positions (what a gather of them must give), so ``follow_plan`` turns the kernel's slab
  positions into global ones (``to_global``) and the backward's global ones back into slab
  positions (``to_slab``) around the local calls;
* under ``plan.apply`` DTensor has no pooling strategy for a split window dim, so the call
  runs here on the local shard (``pool``) and the result keeps the input's placements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

POOLS = {
    **{getattr(F, f"max_pool{n}d"): n for n in (1, 2, 3)},
    **{getattr(F, f"avg_pool{n}d"): n for n in (1, 2, 3)},
}
"""``torch.nn.functional`` pools run here under ``plan.apply`` -> their spatial rank."""
MAX_ARGS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
AVG_ARGS = (
    "kernel_size",
    "stride",
    "padding",
    "ceil_mode",
    "count_include_pad",
    "divisor_override",
)


def split_window_dims(x: Any, spatial: int) -> list[int]:
    """The trailing ``spatial`` dims of DTensor ``x`` some mesh dim splits."""
    if not isinstance(x, DTensor):
        return []
    first = x.ndim - spatial
    return sorted({p.dim for p in x.placements if isinstance(p, Shard) and p.dim >= first})


def slab_offsets(x: DTensor, spatial: int) -> list[Any]:
    """Per trailing spatial dim of ``x``, the global position of this rank's first row (0
    where whole). No data moves: every rank slices its own position out of an ``arange``
    placed as ``x`` places that dim."""
    offsets: list[Any] = []
    for d in range(x.ndim - spatial, x.ndim):
        placements = [Shard(0) if p == Shard(d) else Replicate() for p in x.placements]
        if all(isinstance(p, Replicate) for p in placements):
            offsets.append(0)
            continue
        positions = torch.arange(x.shape[d], dtype=torch.int64)
        local = distribute_tensor(positions, x.device_mesh, placements, src_data_rank=None)
        offsets.append(local.to_local()[0])
    return offsets


def to_global(
    indices: torch.Tensor, local: Sequence[int], whole: Sequence[int], offsets: Sequence[Any]
) -> torch.Tensor:
    """Flat positions in a ``local`` slab (its spatial shape) as flat positions in the
    ``whole`` spatial shape, the slab starting at ``offsets``."""
    return _flat(_coords(indices, local), whole, offsets, 1)


def to_slab(
    indices: torch.Tensor, local: Sequence[int], whole: Sequence[int], offsets: Sequence[Any]
) -> torch.Tensor:
    """The inverse of ``to_global``."""
    return _flat(_coords(indices, whole), local, offsets, -1)


def _coords(flat: torch.Tensor, shape: Sequence[int]) -> list[torch.Tensor]:
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat = flat // size
    return coords[::-1]


def _flat(
    coords: list[torch.Tensor], shape: Sequence[int], offsets: Sequence[Any], sign: int
) -> torch.Tensor:
    out = torch.zeros_like(coords[0])
    for c, size, offset in zip(coords, shape, offsets, strict=True):
        out = out * size + c + sign * offset
    return out


def _window_args(func: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    names = MAX_ARGS if "max" in getattr(func, "__name__", "") else AVG_ARGS
    given = dict(zip(names, args[1:], strict=False))
    given.update(kwargs)
    if set(given) - set(names):
        return None
    return given


def _disjoint(given: dict[str, Any], spatial: int, x: DTensor, dims: list[int]) -> bool:
    """Kernel <= stride, no padding, no dilation, and every split dim's slab a whole number
    of strides."""

    def per_dim(value: Any, default: int) -> list[int]:
        value = default if value is None or value == [] else value
        return [int(value)] * spatial if isinstance(value, int) else [int(v) for v in value]

    kernel = per_dim(given.get("kernel_size"), 1)
    stride = per_dim(given.get("stride") or kernel, 1)
    if any(per_dim(given.get("padding"), 0)) or set(per_dim(given.get("dilation"), 1)) != {1}:
        return False
    if any(k > s for k, s in zip(kernel, stride, strict=True)):
        return False
    first = x.ndim - spatial
    local = x.to_local().shape
    return all(local[d] % stride[d - first] == 0 for d in dims)


def pool(func: Any, args: tuple, kwargs: dict) -> Any:
    """A pool call on a DTensor whose window dims are split, run on the local slab (module
    docstring); ``NotImplemented`` for any other call (DTensor or the fallback runs it)."""
    spatial = POOLS.get(func)
    x = args[0] if args else None
    dims = split_window_dims(x, spatial or 0)
    if spatial is None or not dims or any(isinstance(p, Partial) for p in x.placements):
        return NotImplemented
    given = _window_args(func, args, kwargs)
    if given is None or given.get("return_indices") or not _disjoint(given, spatial, x, dims):
        return NotImplemented
    local = func(x.to_local(), *args[1:], **kwargs)
    shape = func(torch.empty(x.shape, device="meta"), *args[1:], **kwargs).shape
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                              shape=shape, stride=stride)  # fmt: skip
