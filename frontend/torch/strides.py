"""Views of DTensors whose local shard is not laid out as the DTensor's strides say.

A DTensor carries global strides - the eager tensor's, so ``reshape`` decides to view or copy
as eager would - and a local shard with strides of its own. The two can disagree: DTensor's
redistributions return freshly laid out (contiguous) shards while the global strides stay
those of a transpose, and kernels run on redistributed operands return their own layout (a
layer norm's backward on a transposed gradient). A ``view`` that the global strides allow
then fails on the shard with torch's raw "view size is not compatible with input tensor's
size and stride" (HF Swin's window partition in backward, T5's attention under FSDP on
(2, 2, 2)). Autograd's backward of ``view``/``reshape`` is such a view, so no hook at module
level can reach it; the mechanism sits at DTensor's dispatch of ``aten.view``.

``ensure_view_handler`` makes DTensor run such a view on a contiguous copy of the shard: a
contiguous tensor has every view of its numel, and ``view`` means the row-major reshape
whatever the strides, so the values are the eager ones. The copy is local (no collective; the
plan's collectives are unchanged) and happens only where the shard's view fails. The result
does not alias the input's shard: an in-place write through it would not reach the base (a
captured training step writes through no such view: ``functionalize`` would have shown it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

aten = torch.ops.aten

VIEW_OPS = (aten.view.default, aten._unsafe_view.default)
"""The aten views DTensor runs as a view of each local shard."""

_STRIDE_ERROR = "view size is not compatible with input tensor's size and stride"


def ensure_view_handler() -> None:
    """Install ``view_on_shards`` as DTensor's handler of ``VIEW_OPS`` (idempotent).

    Private: DTensor has no public hook for how an op runs on its shards; its dispatcher's
    ``_custom_op_handlers`` (where DTensor keeps ``as_strided``'s and ``convolution``'s) is the
    one place that reaches views run by autograd."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in VIEW_OPS:
        handlers.setdefault(op, view_on_shards)


def view_on_shards(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` as DTensor runs it; where the local shard cannot be viewed, on the shard made
    contiguous (see the module docstring)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)  # the call below takes DTensor's own path
    try:
        try:
            return op(*args, **kwargs)
        except RuntimeError as error:
            if _STRIDE_ERROR not in str(error) or not _shard_differs(args[0]):
                raise
        return op(contiguous_shard(args[0]), *args[1:], **kwargs)
    finally:
        handlers[op] = handler


def _shard_differs(x: Any) -> bool:
    """Whether ``x`` is a DTensor whose shard is not contiguous (the view failed on it)."""
    return isinstance(x, DTensor) and not x._local_tensor.is_contiguous()


def contiguous_shard(x: DTensor) -> DTensor:
    """``x`` with a contiguous local shard, its global shape and strides kept."""
    return DTensor.from_local(
        x._local_tensor.contiguous(), x.device_mesh, x.placements, run_check=False,
        shape=x.shape, stride=x.stride(),
    )  # fmt: skip
