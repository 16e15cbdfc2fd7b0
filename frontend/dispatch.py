"""Which frontend captures a model: the one dispatch every entry point uses.

A ``torch.nn.Module`` goes to the torch frontend, any other callable to the JAX frontend, and an
IR ``Graph`` passes through. torch and jax are imported only when a model of theirs arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from ..ir import FrontendError, Graph

Kind = Literal["graph", "torch", "jax"]


def is_torch_module(model: object) -> bool:
    """``model`` is a ``torch.nn.Module`` (read from its class, so torch is never imported)."""
    return any(c.__module__.startswith("torch.nn") for c in type(model).__mro__)


def frontend_kind(model_or_fn: object) -> Kind:
    """``"graph"`` for an IR Graph, ``"torch"`` for a module, ``"jax"`` for another callable."""
    if isinstance(model_or_fn, Graph):
        return "graph"
    if is_torch_module(model_or_fn):
        return "torch"
    if callable(model_or_fn):
        return "jax"
    raise FrontendError(
        f"cannot plan a {type(model_or_fn).__name__}: pass an IR Graph, a torch.nn.Module "
        "with example inputs, or a JAX callable with example arguments"
    )


def capture_function(kind: Kind) -> Callable[..., tuple[Graph, Any]]:
    """The ``capture(model, *args, **options) -> (graph, context)`` of a frontend."""
    if kind == "torch":
        from .torch.capture import capture

        return capture
    if kind == "jax":
        from .jax.capture import capture as jax_capture

        return jax_capture
    raise FrontendError(f"an IR Graph is not captured; it has no frontend (kind {kind!r})")


def capture(model_or_fn: Any, *example_args: Any, **options: Any) -> tuple[Graph, Any]:
    """``(graph, context)`` of ``model_or_fn`` captured with its example inputs by its frontend;
    a Graph passes through with no context (``None``).

    Args:
        model_or_fn: an IR ``Graph``, a ``torch.nn.Module`` or a JAX callable.
        *example_args: the example inputs (torch tensors, JAX arrays or pytrees of them).
        **options: the frontend's capture options and, for torch, keyword example inputs.

    Returns:
        The captured graph and the frontend's capture context (``None`` for a Graph).
    """
    kind = frontend_kind(model_or_fn)
    if kind == "graph":
        return model_or_fn, None
    return capture_function(kind)(model_or_fn, *example_args, **options)


__all__ = ["capture", "capture_function", "frontend_kind", "is_torch_module"]
