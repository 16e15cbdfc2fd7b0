"""shardplan: a compiler-style sharding planner for ML computation graphs.

``import shardplan`` needs neither torch nor jax; only ``shardplan.frontend`` imports them, lazily.
"""

from . import strategies
from .api import annotate, plan
from .evaluate import Evaluation, evaluate
from .ir import (
    Graph,
    InfeasiblePlanError,
    Mesh,
    Origin,
    Pin,
    Role,
    Sharding,
    ShardplanError,
    TensorType,
    UnsupportedOpWarning,
)
from .ir.errors import ArgumentError, DefaultClusterWarning, IdleAxisWarning
from .solver.plan import Plan, load_plan

__version__ = "0.1.0"
__all__ = [
    "ArgumentError",
    "DefaultClusterWarning",
    "Evaluation",
    "Graph",
    "IdleAxisWarning",
    "InfeasiblePlanError",
    "Mesh",
    "Origin",
    "Pin",
    "Plan",
    "Role",
    "Sharding",
    "ShardplanError",
    "TensorType",
    "UnsupportedOpWarning",
    "annotate",
    "evaluate",
    "load_plan",
    "plan",
    "strategies",
]  # fmt: skip
