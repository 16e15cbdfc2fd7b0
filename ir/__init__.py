"""The sharding IR: meshes, types, shardings, factor rules, ops and graphs (no torch, no jax)."""

from . import conv as _conv  # noqa: F401  (registers the convolution and pooling rules)
from . import moe as _moe  # noqa: F401  (registers the mixture-of-experts rules)
from . import regions as _regions  # noqa: F401  (registers the shard_map region rule)
from . import window as _window  # noqa: F401  (registers the pooling window rules)
from . import writes as _writes  # noqa: F401  (registers the slice-write rule)
from .errors import (
    FrontendError,
    InfeasiblePlanError,
    IRParseError,
    IRVerifyError,
    ShardingError,
    ShardplanError,
    UnsupportedOpWarning,
)
from .graph import Graph, Op, Origin, Role, Use, Value
from .mesh import Mesh
from .op_cost import VIEW_KINDS, op_bytes, op_flops
from .registry import known_kinds, op_info, register_rule, rule_for
from .rules import ShardingRule
from .sharding import Pin, Sharding
from .types import DTYPE_BYTES, TensorType


def __getattr__(name: str):
    """Lazy exports of the text form, verifier and builder (they import the registry)."""
    lazy = {
        "print_graph": ("printer", "print_graph"),
        "parse_graph": ("parser", "parse_graph"),
        "verify": ("verify", "verify"),
        "GraphBuilder": ("builder", "GraphBuilder"),
    }
    if name in lazy:
        import importlib

        module, attr = lazy[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(name)


__all__ = [
    "DTYPE_BYTES",
    "VIEW_KINDS",
    "FrontendError",
    "Graph",
    "IRParseError",
    "IRVerifyError",
    "InfeasiblePlanError",
    "Mesh",
    "Op",
    "Origin",
    "Pin",
    "Role",
    "Sharding",
    "ShardingError",
    "ShardingRule",
    "ShardplanError",
    "TensorType",
    "UnsupportedOpWarning",
    "Use",
    "Value",
    "known_kinds",
    "op_bytes",
    "op_flops",
    "op_info",
    "register_rule",
    "rule_for",
]  # fmt: skip
