"""One jaxpr walk shared by capture (values are IR values) and the emitter (values are arrays).

Call-like primitives (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) are inlined
the same way in both walks. Every equation the walk hands to ``apply`` (and every scan
boundary op) is one numbered *step*; capture records the IR values of each step and the
emitter finds its planned layouts by the same number.

A ``scan`` is walked once (``unroll=False``, the default): its body becomes IR ops that run
``length`` times (``Op.repeat``), between four boundary steps per carry / stacked operand /
stacked result (``scan_carry``, ``scan_index``, ``scan_loop``, ``scan_stack``); the emitter
binds a ``lax.scan`` whose body is pinned at the planned layouts. With ``unroll=True`` every
iteration is walked (and planned) on its own; its outputs stay lazy (``Stacked``), so a later
scan (the backward pass) over the same stacked residuals takes each layer's piece directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from jax.extend.core import ClosedJaxpr, Literal

T = TypeVar("T")

# Primitive name -> the parameter holding the jaxpr to inline.
INLINED = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
    "remat": "jaxpr",
}  # fmt: skip

# Identity-like primitives: outputs are the inputs (user constraints are replaced by the plan;
# capture records them as pins first, see ``Walker.pass_through``).
PASS_THROUGH = frozenset(
    {"sharding_constraint", "device_put", "optimization_barrier", "mesh_cast", "reshard", "pvary"}
)


@dataclass(eq=False)
class Stacked(Generic[T]):
    """A scan output: one piece per iteration, stacked on demand (once)."""

    pieces: list[T]
    stacked: T | None = None


@dataclass
class Walker(Generic[T]):
    """Evaluate a jaxpr over some value domain; subclasses say what one step does."""

    step: int = 0
    """Number of the current step (the key shared by capture and emitter); ``apply``, ``index``
    and ``stack`` read it, the walk advances it."""
    modules: list[str] = field(default_factory=list)
    """Module path of the code being walked (``layers.3`` inside a scan's 4th iteration)."""
    call_sites: list[Any] = field(default_factory=list)
    """The inlined call equations enclosing the current one, outermost first."""
    unroll: bool = False
    """Walk every scan iteration (True) or each scan body once (False)."""
    repeat: int = 1
    """How many times per step the code being walked runs (the trip counts of the enclosing
    scans, when bodies are walked once)."""

    # -- what subclasses provide ------------------------------------------------------------
    def apply(self, eqn: Any, ins: list[T]) -> list[T]:
        raise NotImplementedError

    def literal(self, value: Any, aval: Any) -> T:
        raise NotImplementedError

    def constant(self, value: Any) -> T:
        raise NotImplementedError

    def index(self, x: T, i: int) -> T:
        """Layer ``i`` of a stacked value (drops the leading axis)."""
        raise NotImplementedError

    def stack(self, pieces: list[T]) -> T:
        raise NotImplementedError

    def loop(self, eqn: Any, consts: list[T], init: list[T], xs: list[T]) -> list[T]:
        """A scan walked once: its final carries and stacked results."""
        raise NotImplementedError

    def pass_through(self, eqn: Any, ins: list[T]) -> list[T]:
        """An identity-like equation (``PASS_THROUGH``): no step, the outputs are the inputs."""
        return ins[: len(eqn.outvars)]

    # -- the walk --------------------------------------------------------------------------
    def run(self, jaxpr: Any, consts: list[Any], args: list[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = value
        for var, value in zip(jaxpr.invars, args, strict=True):
            env[var] = value
        for eqn in jaxpr.eqns:
            lazy = eqn.primitive.name == "scan" or eqn.primitive.name in INLINED
            ins = [self._read(env, v, lazy) for v in eqn.invars]
            outs = self._equation(eqn, ins)
            for var, value in zip(eqn.outvars, outs, strict=True):
                env[var] = value
        return [self._read(env, v, lazy=True) for v in jaxpr.outvars]

    def run_closed(self, closed: Any, args: list[Any]) -> list[Any]:
        if isinstance(closed, ClosedJaxpr):
            consts = [self.constant(c) for c in closed.consts]
            return self.run(closed.jaxpr, consts, args)
        return self.run(closed, [], args)

    def materialize(self, value: Any) -> T:
        if isinstance(value, Stacked):
            if value.stacked is None:
                value.stacked = self.stack(value.pieces)
                self.step += 1
            return value.stacked
        return value

    def _read(self, env: dict[Any, Any], var: Any, lazy: bool = False) -> Any:
        if isinstance(var, Literal):
            return self.literal(var.val, var.aval)
        value = env[var]
        return value if lazy else self.materialize(value)

    def _equation(self, eqn: Any, ins: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        if name in INLINED:
            self.call_sites.append(eqn)
            try:
                return self.run_closed(eqn.params[INLINED[name]], ins)
            finally:
                self.call_sites.pop()
        if name in PASS_THROUGH:
            return self.pass_through(eqn, ins)
        if name == "scan":
            return self._scan(eqn, ins)
        outs = self.apply(eqn, ins)
        self.step += 1
        return outs

    def _scan(self, eqn: Any, ins: list[Any]) -> list[Any]:
        if not self.unroll:
            p = eqn.params
            ins = [self.materialize(x) for x in ins]
            carry_at = p["num_consts"] + p["num_carry"]
            return self.loop(
                eqn, ins[: p["num_consts"]], ins[p["num_consts"] : carry_at], ins[carry_at:]
            )
        return self._unrolled(eqn, ins)

    @contextmanager
    def body(self, length: int) -> Iterator[None]:
        """Walk a scan body once, standing for its ``length`` iterations."""
        outer = self.repeat
        self.repeat = outer * length
        try:
            with self.module("layers"):
                yield
        finally:
            self.repeat = outer

    def _unrolled(self, eqn: Any, ins: list[Any]) -> list[Any]:
        """Unroll: iteration i sees layer i of every ``xs`` and yields layer i of every ``ys``."""
        p = eqn.params
        n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
        consts, carry = ins[:n_consts], ins[n_consts : n_consts + n_carry]
        xs = ins[n_consts + n_carry :]
        n_ys = len(eqn.outvars) - n_carry
        ys: list[list[Any]] = [[None] * length for _ in range(n_ys)]
        order = reversed(range(length)) if p["reverse"] else range(length)
        for i in order:
            with self.module(f"layers.{i}"):
                x_i = [self._index(x, i) for x in xs]
                outs = self.run_closed(p["jaxpr"], [*consts, *carry, *x_i])
            carry = [self.materialize(c) for c in outs[:n_carry]]
            for k, y in enumerate(outs[n_carry:]):
                ys[k][i] = self.materialize(y)
        return [*carry, *(Stacked(pieces) for pieces in ys)]

    def _index(self, x: Any, i: int) -> T:
        if isinstance(x, Stacked):
            return x.pieces[i]
        out = self.index(x, i)
        self.step += 1
        return out

    @contextmanager
    def module(self, name: str) -> Iterator[None]:
        self.modules.append(name)
        try:
            yield
        finally:
            self.modules.pop()
