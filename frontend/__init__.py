"""The frontends (torch, JAX): capture a model as IR (``capture``, the one dispatch between
them) and emit plans back to it.

Import-light: importing this package registers the emitters behind ``Plan.apply`` /
``Plan.jit`` (``emitters.py``) and imports neither torch nor jax.
"""

from . import emitters as emitters
from .dispatch import capture, capture_function, frontend_kind, is_torch_module

__all__ = ["capture", "capture_function", "emitters", "frontend_kind", "is_torch_module"]
