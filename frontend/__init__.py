"""The frontends (torch, JAX) and the one dispatch between them (``capture``)."""

from .dispatch import capture, capture_function, frontend_kind, is_torch_module

__all__ = ["capture", "capture_function", "frontend_kind", "is_torch_module"]
