"""Graph passes and the pass manager; importing this package registers every pass by name.

To add a pass: write ``passes/<name>.py`` with ``@register_pass("<kebab-name>", options=...)``
and add one import line below. The planner's own passes (``PlannerPass`` objects with one
``apply(state)``, ``planner_registry.py``) are registered by ``shardplan.solver.planner``.
"""

from __future__ import annotations

# one import per pass module: importing it registers the pass
from . import (
    annotate,  # noqa: F401
    propagate,  # noqa: F401
    repeated_layers,  # noqa: F401
)
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
from .planner_registry import (
    PlannerPass,
    list_planner_passes,
    normalize_planner_pipeline,
    parse_planner_pipeline,
    planner_pass,
    register_planner_pass,
)

__all__ = [
    "NoOptions", "PassInfo", "PassManager", "PassSpec", "PlannerPass", "get_pass",
    "list_passes", "list_planner_passes", "normalize_planner_pipeline", "parse_pipeline",
    "parse_planner_pipeline", "planner_pass", "register_pass", "register_planner_pass",
    "run_pipeline",
]  # fmt: skip
