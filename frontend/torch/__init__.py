"""PyTorch binding: capture an nn.Module's training step as IR, emit DTensor / FSDP2 plans.

Import-light on purpose: nothing here imports torch until a submodule is used
(``shardplan.frontend.torch.capture``, ``.emit``, ``.simulate``).
"""

from __future__ import annotations

__all__ = ["capture"]


def capture(model, *example_inputs, **options):  # type: ignore[no-untyped-def]
    """Lazy forwarder to :func:`shardplan.frontend.torch.capture.capture`."""
    from .capture import capture as _capture

    return _capture(model, *example_inputs, **options)
