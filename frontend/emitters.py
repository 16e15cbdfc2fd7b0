"""The emitters behind ``Plan.apply``, ``Plan.jit`` and the others: the frontends' public
functions, registered with ``solver.plan.register_emitter``.

Nothing here imports torch or jax: each function loads its frontend's ``emit`` module when it
is called (``lazy.load``), so ``import shardplan`` stays framework-free and a loaded plan
(``sp.load_plan``) still has ``.apply`` / ``.jit``.
"""

from __future__ import annotations

from ..solver.plan import register_emitter
from . import jax as jax_frontend
from . import torch as torch_frontend

TORCH_EMITTERS = ("apply", "to_placements", "to_parallelize_plan", "pipeline_split_spec")
"""``shardplan.frontend.torch`` functions ``Plan`` forwards to."""
JAX_EMITTERS = ("jit", "in_shardings", "out_shardings", "to_partition_specs")
"""``shardplan.frontend.jax`` functions ``Plan`` forwards to."""


def register_frontend_emitters() -> None:
    """Register (again) every frontend emitter under its ``Plan`` method's name."""
    for name in TORCH_EMITTERS:
        register_emitter(name, getattr(torch_frontend, name))
    for name in JAX_EMITTERS:
        register_emitter(name, getattr(jax_frontend, name))


register_frontend_emitters()
