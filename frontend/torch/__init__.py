"""PyTorch binding: capture an nn.Module's training step as IR, emit DTensor / FSDP2 plans.

Import-light on purpose: nothing here imports torch until a function is called or a submodule
is used (``shardplan.frontend.torch.capture``, ``.emit``, ``.simulate``). The emitters are
these functions (``Plan.apply`` and the others call them through ``solver.plan``'s registry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...solver.plan import Plan
from ..lazy import load

__all__ = ["apply", "capture", "pipeline_split_spec", "to_parallelize_plan", "to_placements"]


def _emit(name: str) -> Callable[..., Any]:
    """``emit.<name>`` (importing torch the first time)."""
    return load(f"{__name__}.emit", "torch", name)


def capture(model, *example_inputs, **options):  # type: ignore[no-untyped-def]
    """Lazy forwarder to :func:`shardplan.frontend.torch.capture.capture`."""
    from .capture import capture as _capture

    return _capture(model, *example_inputs, **options)


def apply(plan: Plan, model: Any, device_mesh: Any) -> Any:
    """``model`` with DTensor parameters on ``device_mesh`` and activations and gradients moved
    as ``plan`` says, trained as planned (``emit.apply``; ``plan.apply(model, device_mesh)``)."""
    return _emit("apply")(plan, model, device_mesh)


def to_placements(plan: Plan) -> Any:
    """``{param_fqn: (Shard|Replicate|Partial, ...) per mesh dim}`` (``emit.to_placements``)."""
    return _emit("to_placements")(plan)


def to_parallelize_plan(plan: Plan) -> Any:
    """``parallelize_module`` styles and ``fully_shard`` calls where the plan is expressible
    (``styles.py``)."""
    return _emit("to_parallelize_plan")(plan)


def pipeline_split_spec(plan: Plan) -> Any:
    """``{"model.layers.8": SplitPoint.BEGINNING, ...}`` for torch.distributed.pipelining
    (``pipeline.py``)."""
    return _emit("pipeline_split_spec")(plan)
