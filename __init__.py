"""shardplan: a compiler-style sharding planner for ML computation graphs.

``import shardplan`` needs neither torch nor jax; only ``shardplan.frontend`` imports them, lazily.
"""

from . import strategies
from .api import annotate, plan
from .costmodel.dense_part import DenseSpec
from .costmodel.embedding import TableSpec
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
from .ir.errors import ArgumentError, IdleAxisWarning, IdleDevicesWarning
from .recsys import plan_tables, torchrec_plan
from .solver.plan import Plan, load_plan
from .solver.table_plan import TablePlan
from .whatif import WhatIf, whatif

__version__ = "0.1.0"
__all__ = [
    "ArgumentError",
    "DenseSpec",
    "Evaluation",
    "Graph",
    "IdleAxisWarning",
    "IdleDevicesWarning",
    "InfeasiblePlanError",
    "Mesh",
    "Origin",
    "Pin",
    "Plan",
    "Role",
    "Sharding",
    "ShardplanError",
    "TablePlan",
    "TableSpec",
    "TensorType",
    "UnsupportedOpWarning",
    "WhatIf",
    "annotate",
    "evaluate",
    "load_plan",
    "plan",
    "plan_tables",
    "strategies",
    "torchrec_plan",
    "whatif",
]  # fmt: skip
