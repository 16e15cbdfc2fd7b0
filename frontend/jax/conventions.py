"""The JAX calling conventions ``sp.plan`` accepts besides plain pytrees of arrays (issue 37).

* **Flax NNX**, functional: ``graphdef, state = nnx.split((model, optimizer))`` and a step over
  ``state``. Roles come from each leaf's ``nnx.Variable`` type, not from names: ``nnx.Param``
  is a parameter, optimizer state (``nnx.optimizer.OptState``) and other variables
  (``nnx.BatchStat``: mutable model state, held and updated by the step) are optimizer-state
  inputs (``variable_roles``).
* **Flax NNX**, in place (``@nnx.jit`` updating ``model`` / ``optimizer`` and returning only the
  loss): the update is invisible to a plan of what the function returns, so it is refused with
  the functional form to write (``InPlaceCheck``).
* **Equinox** (modules with function fields, as ``eqx.filter_jit`` takes them): leaves that are
  not arrays are static, exactly as ``eqx.partition(args, eqx.is_array)`` splits them; the
  step is traced and jitted over the array part and recombined (``Filtered``).
* **Flax Linen** (``params``, ``batch_stats`` as mutable state) and **optax** states are plain
  pytrees: roles by key name (``capture.default_role``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ...ir import FrontendError, Role

_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, bool, int, float, complex)


_PYTHON_SCALARS = (bool, int, float, complex)
"""Traced in a plain pytree (as ``jax.jit`` does); static once a function's arguments are
filtered, as ``eqx.is_array`` says."""


def is_array(leaf: Any) -> bool:
    """Array-like leaves are traced; anything else (functions, strings) is static."""
    return isinstance(leaf, _ARRAYS) or hasattr(leaf, "aval")


def _dynamic(leaf: Any) -> bool:
    """Traced once arguments are filtered (``eqx.is_array``): arrays, not Python scalars."""
    return is_array(leaf) and not isinstance(leaf, _PYTHON_SCALARS)


def _nnx() -> Any:
    """``flax.nnx`` if the user's program loaded it (never imported here otherwise)."""
    return sys.modules.get("flax.nnx")


def variable_roles(args: tuple[Any, ...]) -> list[Role | None]:
    """Per array leaf of ``args`` (flatten order), the role its ``nnx.Variable`` type says;
    None for leaves outside a Variable (their names decide)."""
    nnx = _nnx()
    if nnx is None:
        return [None] * len(jax.tree_util.tree_leaves(args))
    roles: list[Role | None] = []
    for leaf in jax.tree_util.tree_leaves(args, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if not isinstance(leaf, nnx.Variable):
            roles.append(None)
            continue
        role = Role.PARAMETER if isinstance(leaf, nnx.Param) else Role.OPTIMIZER_STATE
        roles.extend([role] * len(jax.tree_util.tree_leaves(leaf)))
    return roles


def _variables(args: tuple[Any, ...]) -> list[tuple[str, Any]]:
    nnx = _nnx()
    if nnx is None:
        return []
    found = jax.tree_util.tree_flatten_with_path(
        args, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    return [(jax.tree_util.keystr(p), v) for p, v in found if isinstance(v, nnx.Variable)]


@dataclass(eq=False)
class InPlaceCheck:
    """Wraps the traced function: a step that writes new values into its arguments' NNX
    Variables and does not return them (an in-place ``nnx.jit`` / ``nnx.Optimizer.update``
    step, a train-mode BatchNorm's running stats) is refused after the trace; a functional
    step writes them too (``nnx.merge`` shares the state's Variables) but returns them.
    ``jax.make_jaxpr`` rebuilds the argument Modules around tracers, so the writes land on
    those copies and the user's objects stay as they were."""

    fn: Callable[..., Any]
    changed: list[str] = field(default_factory=list)

    def __call__(self, *args: Any) -> Any:
        variables = _variables(args)
        before = [v.get_value() for _, v in variables]
        out = self.fn(*args)
        returned = {id(leaf) for leaf in jax.tree_util.tree_leaves(out)}
        self.changed = [
            p
            for (p, v), old in zip(variables, before, strict=True)
            if v.get_value() is not old and id(v.get_value()) not in returned
        ]
        return out

    def check(self, name: str) -> None:
        if not self.changed:
            return
        shown = ", ".join(self.changed[:3]) + (", ..." if len(self.changed) > 3 else "")
        raise FrontendError(
            f"{name} updates its arguments' nnx Variables in place ({shown}), which a plan of "
            "what it returns would drop; write it functionally: graphdef, state = "
            "nnx.split((model, optimizer)); def step(state, x, y): model, optimizer = "
            "nnx.merge(graphdef, state); ...; return nnx.state((model, optimizer)), loss; "
            "then sp.plan(step, state, x, y)"
        )


@dataclass(eq=False)
class Filtered:
    """A function over pytrees with static (non-array) leaves, as ``eqx.filter_jit`` runs it:
    traced over ``dynamic(args)`` (static leaves replaced by None), recombined inside."""

    fn: Callable[..., Any]
    tree: Any
    """PyTreeDef of the full positional arguments."""
    static: list[Any]
    """Per leaf: the static value, or None for an array leaf."""
    mask: list[bool]
    out_tree: Any = None
    out_static: list[Any] = field(default_factory=list)
    out_mask: list[bool] = field(default_factory=list)

    @staticmethod
    def of(fn: Callable[..., Any], args: tuple[Any, ...]) -> Filtered | None:
        """None when every leaf is an array (the function is traced as it is)."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        if all(is_array(leaf) for leaf in leaves):
            return None
        mask = [_dynamic(leaf) for leaf in leaves]
        static = [None if m else leaf for leaf, m in zip(leaves, mask, strict=True)]
        return Filtered(fn, tree, static, mask)

    def dynamic(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != self.tree:
            raise FrontendError(f"arguments {tree} do not match the planned ones {self.tree}")
        return jax.tree_util.tree_unflatten(
            tree, [leaf if m else None for leaf, m in zip(leaves, self.mask, strict=True)]
        )

    def traced(self, *dynamic: Any) -> Any:
        """``fn`` on the recombined arguments; returns the array part of its result."""
        arrays = iter(jax.tree_util.tree_leaves(dynamic))
        leaves = [next(arrays) if m else s for m, s in zip(self.mask, self.static, strict=True)]
        out = self.fn(*jax.tree_util.tree_unflatten(self.tree, leaves))
        out_leaves, self.out_tree = jax.tree_util.tree_flatten(out)
        self.out_mask = [_dynamic(leaf) for leaf in out_leaves]
        self.out_static = [None if m else x for x, m in zip(out_leaves, self.out_mask, strict=True)]
        masked = [x if m else None for x, m in zip(out_leaves, self.out_mask, strict=True)]
        return jax.tree_util.tree_unflatten(self.out_tree, masked)

    def combine(self, out: Any) -> Any:
        """The full result from the array part ``traced`` returned."""
        arrays = iter(jax.tree_util.tree_leaves(out))
        leaves = [
            next(arrays) if m else s for m, s in zip(self.out_mask, self.out_static, strict=True)
        ]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)

    def wrap(self, jitted: Callable[..., Any]) -> Callable[..., Any]:
        """``jitted`` (over the dynamic arguments) called with the full ones."""

        def run(*args: Any) -> Any:
            return self.combine(jitted(*self.dynamic(args)))

        run.__name__ = getattr(self.fn, "__name__", "planned")
        run.lower = lambda *args: jitted.lower(*self.dynamic(args))  # type: ignore[attr-defined]
        return run
