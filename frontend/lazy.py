"""A frontend module loaded on first use, with a clear error when its framework is missing."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..ir import FrontendError

_INSTALL = {"torch": "pip install torch", "jax": 'pip install "jax[cpu]"'}


def load(module: str, framework: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported after ``framework`` (``"torch"`` or ``"jax"``); a
    ``FrontendError`` naming the framework and how to install it when it does not import."""
    try:
        importlib.import_module(framework)
    except ImportError as error:
        raise FrontendError(
            f"{name} needs {framework}, which cannot be imported here ({error}); install it "
            f"({_INSTALL[framework]}) to emit this plan for {framework}"
        ) from error
    return getattr(importlib.import_module(module), name)
