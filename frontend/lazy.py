"""A frontend module loaded on first use, with a clear error when its framework is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..ir import FrontendError

_INSTALL = {"torch": "pip install torch", "jax": 'pip install "jax[cpu]"'}


def load(module: str, framework: str) -> ModuleType:
    """``import_module(module)`` after ``framework`` (``"torch"`` or ``"jax"``) imports; a
    ``FrontendError`` naming the framework and how to install it when it does not."""
    try:
        importlib.import_module(framework)
    except ImportError as error:
        raise FrontendError(
            f"{module.rsplit('.', 1)[-1]} needs {framework}, which cannot be imported here "
            f"({error}); install it ({_INSTALL[framework]}) to emit this plan for {framework}"
        ) from error
    return importlib.import_module(module)
