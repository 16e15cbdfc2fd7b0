"""shardplan: a compiler-style sharding planner for ML computation graphs.

``import shardplan`` needs neither torch nor jax; only ``shardplan.frontend`` imports them, lazily.
"""

from . import frontend, strategies  # frontend registers Plan's emitters (imports no framework)
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
from .solver.plan import Plan, load_plan, register_emitter
from .solver.table_plan import TablePlan
from .titan_config import TitanConfig, TitanConfigError
from .titan_emit import TitanEmission, evaluate_torchtitan, to_torchtitan
from .titan_search import TitanSearch, search_torchtitan
from .whatif import WhatIf, whatif

register_emitter("to_torchtitan", to_torchtitan)  # Plan.to_torchtitan

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
    "TitanConfig",
    "TitanConfigError",
    "TitanEmission",
    "TitanSearch",
    "UnsupportedOpWarning",
    "WhatIf",
    "annotate",
    "evaluate",
    "evaluate_torchtitan",
    "frontend",
    "load_plan",
    "plan",
    "plan_tables",
    "search_torchtitan",
    "strategies",
    "to_torchtitan",
    "torchrec_plan",
    "whatif",
]  # fmt: skip
