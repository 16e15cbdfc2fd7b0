"""shardplan: a compiler-style sharding planner for ML computation graphs.

``import shardplan`` needs neither torch nor jax; only ``shardplan.frontend`` imports them, lazily.
"""

from . import frontend  # registers Plan's emitters (imports no framework)
from .api.evaluate import Evaluation, evaluate
from .api.plan import annotate, plan
from .api.recsys import plan_tables, torchrec_plan
from .api.torchtitan import TitanEmission, evaluate_torchtitan, to_torchtitan
from .api.whatif import WhatIf, whatif
from .costmodel.dense_part import DenseSpec
from .costmodel.embedding import TableSpec
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
from .solver import strategies
from .solver.plan import Plan, load_plan, register_emitter
from .solver.table_plan import TablePlan
from .solver.titan_config import TitanConfig, TitanConfigError
from .solver.titan_search import TitanSearch, search_torchtitan

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
