"""Graph passes and the pass manager; importing this package registers every pass by name.

To add a pass: write ``passes/<name>.py`` with ``@register_pass("<kebab-name>", options=...)``
and add one import line below.
"""

from __future__ import annotations

from . import annotate, propagate  # noqa: F401  (registers "annotate", "propagate")
from .manager import (
    NoOptions,
    PassInfo,
    PassManager,
    PassSpec,
    get_pass,
    list_passes,
    parse_pipeline,
    register_pass,
    run_pipeline,
)

__all__ = [
    "NoOptions", "PassInfo", "PassManager", "PassSpec", "get_pass", "list_passes",
    "parse_pipeline", "register_pass", "run_pipeline",
]  # fmt: skip
