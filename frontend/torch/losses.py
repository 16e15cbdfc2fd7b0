"""Losses of elementwise terms on local shards under ``follow_plan``.

DTensor has no strategy for ``binary_cross_entropy_with_logits`` (the fallback would gather
the logits and targets), while its IR rule (``ir/nn_rules.pointwise_loss``) lets every dim
split: each rank sums the terms of its shard, so a mean or sum loss is a plain pending sum
over the mesh dims that split the logits (the mean divides by the whole count), and
``reduction="none"`` keeps the logits' layout.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

LOCAL = ("aten.binary_cross_entropy_with_logits.default",)
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def run_step(follower: Any, step: Any, args: tuple, kwargs: dict) -> DTensor:
    """``binary_cross_entropy_with_logits(x, y, weight, pos_weight, reduction)`` on the rank's
    shard of ``x`` (its operands at their planned layouts, which split alike)."""
    x, y = args[0], args[1]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    pos_weight = args[3] if len(args) > 3 else kwargs.get("pos_weight")
    reduction = _REDUCTIONS[int(args[4] if len(args) > 4 else kwargs.get("reduction", 1))]
    if not isinstance(x, DTensor) or any(isinstance(p, Partial) for p in x.placements):
        return None  # type: ignore[return-value]
    terms = F.binary_cross_entropy_with_logits(
        _local(x), _local(y), _local(weight), reduction="none" if reduction == "none" else "sum",
        pos_weight=_local(pos_weight),
    )  # fmt: skip
    mesh = x.device_mesh
    if reduction == "none":
        return DTensor.from_local(terms, mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=x.stride())  # fmt: skip
    if reduction == "mean":
        terms = terms / x.numel()
    pending = [Partial() if isinstance(p, Shard) else Replicate() for p in x.placements]
    return DTensor.from_local(terms, mesh, pending, run_check=False)
