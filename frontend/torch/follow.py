"""Run an applied module so that every aten op computes at the layouts the plan chose.

``plan.apply`` alone redistributes at module boundaries and lets DTensor pick layouts inside a
module, so its collectives are DTensor's, not the plan's. Inside ``follow_plan(plan, mesh)`` a
dispatch mode replays the captured step: each aten call (and each ``shardplan::moe_*`` call of
the MoE dispatch, forward and backward) at run time is matched to the next
captured call (``TorchContext.steps``, same order: the same module runs the same autograd graph),
its tensor operands are redistributed to the planned operand layouts, and its results are
checked against (and moved to) the planned result layouts. The collectives issued are then
exactly the plan's reshards.

These calls are run differently from DTensor's own dispatch (docs/torch.md, "Following a plan"):
  - ``addmm``/``baddbmm`` run as their IR lowering, ``mm`` then ``add``, so a reshard the plan
    puts between the product and the bias add happens there (DTensor fuses the two);
  - the CPU fused attention kernels have no DTensor strategy: they run on the local shards
    (batch and heads split, head dims and keys whole: what the IR rule allows; a query
    sequence split gets its shifted causal mask from ``context_parallel``);
  - under a causal query split the step runs in the head-tail token order the cost model
    prices (``context_parallel``): the data inputs are reordered where they are read, the
    traced ``arange`` of the sequence positions yields that order, so rotary positions and
    the causal mask follow it (logits come back in that order; loss and gradients do not
    depend on it);
  - ``ones_like``-style fills the IR makes constants are made at their planned layout;
  - calls the trace did not record (``_fused_sdp_choice``, autograd bookkeeping) run untouched
    and are listed in ``deviations``, except ``AccumulateGrad``'s layout copy of a gradient
    (``new_empty_strided`` + ``copy_`` at the gradient's placements: no data moves).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode  # documented home of dispatch modes
from torch.utils.weak import WeakIdKeyDictionary

from ...ir import FrontendError, Sharding
from ...solver.plan import Plan
from . import (  # modules: apply_mode imports this one too
    apply_mode,
    bags,
    context_parallel,
    conv_local,
    fallback,
    follow_calls,
    lookup,
    losses,
    nn_local,
    reshard,
    strides,
    view_writes,
)
from .capture import VIEW_CALLS, AtenStep, TorchContext, leaves
from .follow_match import ADD, VIEW, TraceMatcher, identity_call, in_place_target
from .plan_layouts import Placements, context_of, placements_of

_ATTENTION = ("aten._scaled_dot_product_flash_attention_for_cpu",)
_TRACED_AS = {"aten.lift_fresh.default": "aten.lift_fresh_copy.default"}
"""Run-time calls that ``make_fx`` records under another name."""
_ADD = ADD
_EMBEDDING = "aten.embedding.default"
_CLONE = "aten.clone.default"
_AS_STRIDED = "aten.as_strided.default"
_COPY = "aten.copy_.default"
_IN_PLACE_ADDS = ("aten.add_.Tensor", "aten.sub_.Tensor")
_NEW_EMPTY_STRIDED = "aten.new_empty_strided.default"
_FILLS_LIKE = (
    "aten.ones_like.default", "aten.zeros_like.default", "aten.full_like.default",
    "aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default",
)  # fmt: skip
"""Fills shaped like an operand (or sized by the call: ``labels.new_zeros(shape)``); the IR
makes them constants (no operand to follow)."""
_REPLAYED = ("aten", "shardplan")
"""Op namespaces the trace records and the follower replays (``shardplan``: the MoE ops)."""

_ACTIVE: list[PlanFollower] = []


def following() -> bool:
    """True inside ``follow_plan`` (emit's boundary hooks stand aside then)."""
    return bool(_ACTIVE) and _ACTIVE[-1].paused == 0


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Run emitter bookkeeping (input distribution, gradient reshards) outside the replay."""
    follower = _ACTIVE[-1] if _ACTIVE else None
    if follower is not None:
        follower.paused += 1
    try:
        yield
    finally:
        if follower is not None:
            follower.paused -= 1


@contextlib.contextmanager
def follow_plan(plan: Plan, device_mesh: DeviceMesh) -> Iterator[PlanFollower]:
    """Forward and backward inside this context compute at the planned layouts.

    Use around the applied module's forward *and* ``backward()``; the optimizer step runs
    outside. Yields the follower, whose ``deviations`` lists what did not go as planned.
    """
    strides.ensure_view_handler()  # views of shards laid out unlike their DTensor
    follower = PlanFollower(plan, device_mesh)
    _ACTIVE.append(follower)
    try:
        with follower:
            yield follower
    finally:
        _ACTIVE.pop()
        follower.matcher.finish()


def same_layout(have: Placements, want: Placements) -> bool:
    """Equal placements, any ``Partial`` reduce op matching a planned partial."""
    return all(
        h == w or (isinstance(h, Partial) and isinstance(w, Partial))
        for h, w in zip(have, want, strict=True)
    )


class PlanFollower(TorchDispatchMode):
    """The dispatch mode behind ``follow_plan`` (see the module docstring)."""

    def __init__(self, plan: Plan, device_mesh: DeviceMesh) -> None:
        super().__init__()
        self.plan = plan
        self.mesh = device_mesh
        context: TorchContext = context_of(plan)
        if context.stamped:
            raise FrontendError(
                "this plan's capture stamped repeated layers instead of tracing them, so there "
                "is no aten call list to follow; plan with stamp_layers=False to use follow_plan"
            )
        fallback.ensure_strategies(context.traced_ops)  # ops DTensor cannot shard run whole
        replayed = [s for s in context.steps if s.module != "optimizer"]
        self.steps = [s for s in replayed if not s.identity]
        self.same: dict[str, str] = {}
        """Result of a traced identity call -> the value it passes on (one name for matching)."""
        self.identity_of: dict[str, tuple[str, int]] = {}
        """Result of a traced identity call -> (its operand, its IR op index)."""
        for s in replayed:
            if s.identity and s.operands and s.operands[0] and s.results and s.results[0]:
                self.same[s.results[0]] = self.same.get(s.operands[0], s.operands[0])
                if s.ops:
                    self.identity_of[s.results[0]] = (s.operands[0], s.ops[0])
        self.made: dict[str, tuple[torch.Tensor, str | None, DTensor]] = {}
        """Identity result -> (the run-time tensor it was made from, the value that tensor held
        then, the tensor at the identity result's layout)."""
        self.fill_layout: dict[str, str] = {}
        """Result of an uninitialised factory -> the in-place call's result it is the target of
        (made at that layout: DTensor keeps an in-place target's placements)."""
        made_by = {r: s.target for s in self.steps for r in s.results if r is not None}
        for s in self.steps:
            if (
                in_place_target(s.target)
                and s.operands
                and made_by.get(s.operands[0] or "") in _EMPTY
            ):
                self.fill_layout.setdefault(s.operands[0] or "", s.results[0] or "")
        self.empty = {v.name for v in plan.graph.values() if tuple(v.type.shape) == (0,)}
        """Values that are a legacy ``torch.tensor([])`` (a ``cat`` operand eager ``cat`` skips)."""
        self.written = view_writes.written_views(self.steps)
        """Views some traced write reaches the base of (``view_writes``)."""
        self.bases: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Run-time view (of a name in ``written``) -> (the tensor it views, its window)."""
        self.layout_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Run-time ``new_empty_strided`` target -> the gradient ``AccumulateGrad`` copies in."""
        self.paused = 0
        self.deviations: list[str] = []
        """Run-time calls not in the trace, skipped trace calls and layouts not as planned."""
        shapes = {v.name: tuple(v.type.shape) for v in plan.graph.values()}
        self.matcher = TraceMatcher(self.steps, self.same, self.empty, self.deviations, shapes)
        self.names: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Run-time tensor -> the IR value it holds (results of replayed calls)."""
        self.order: list[int] | None = None
        """The head-tail token order of a causal query split (None: contiguous)."""
        try:
            self.order = context_parallel.plan_order(plan)
        except ValueError as e:
            self.deviations.append(f"context parallelism runs contiguous chunks: {e}")
        self.sequence_inputs = (
            {} if self.order is None else context_parallel.sequence_inputs(plan, self.order)
        )
        """Data input -> the index its sequence is reordered by (balanced order only)."""
        self.reordered: dict[str, WeakIdKeyDictionary] = {}
        """Data input -> {run-time tensor: the same in the balanced order}, one copy each."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.paused or getattr(func, "namespace", "") not in _REPLAYED:
            return func(*args, **kwargs)  # collectives and DTensor internals pass through
        target = _TRACED_AS.get(str(func), str(func))
        tensors = leaves((args, kwargs), torch.Tensor)
        if identity_call(target, args):  # bookkeeping of hooks and autograd: moves no data
            out = func(*args, **kwargs)
            if tensors and tensors[0] in self.names and isinstance(out, torch.Tensor):
                self.names[out] = self.names[tensors[0]]
            return out
        known = [self.names.get(t) for t in tensors]
        shapes = [tuple(t.shape) if isinstance(t, DTensor) else None for t in tensors]
        step = self.matcher.match(target, known, shapes)
        if step is None and target == _ADD:
            step = self.matcher.match_sum(known)
        if step is None and target == VIEW and (pair := self.matcher.match_copied_reshape(known)):
            return follow_calls.copied_reshape(self, pair, args)
        if step is None and target == _CLONE and self.names.get(tensors[0]) is not None:
            self.deviations[-1:] = []  # ``.contiguous()`` where a run-time stride differs
            out = func(*args, **kwargs)
            self.names[out] = self.names[tensors[0]]  # the same values, at the same layout
            return out
        if step is None and (copy := self._layout_copy(func, target, args, kwargs)) is not None:
            return copy
        if step is None:
            if target in _IN_PLACE_ADDS and isinstance(args[0], DTensor):  # e.g. `a += b`
                args = (args[0], apply_mode.pending_like(args[0], args[1]), *args[2:])
            out = func(*args, **kwargs)
            if target == _ADD and None not in known and isinstance(out, torch.Tensor):
                self.names[out] = self.matcher.partial_sum(known)  # a sum the trace made otherwise
            return out
        step = conv_local.aligned(self.plan, step, args)
        out = self._run(step, func, args, kwargs)
        self._name(step, out, args)
        return out

    def _name(self, step: AtenStep, out: Any, args: tuple) -> None:
        """Remember the IR values a replayed call's results hold (and a written view's base)."""
        for t, name in zip(leaves(out, torch.Tensor), step.results, strict=False):
            if name is not None:
                self.names[t] = name
        if step.target in view_writes.VIEW_TARGETS and step.results[0] in self.written:
            self.bases[out] = (args[0], view_writes.window(step.target, args))  # writes reach it

    def _layout_copy(self, func: Any, target: str, args: tuple, kwargs: dict) -> Any:
        """``AccumulateGrad`` giving a gradient its parameter's strides (the trace has neither
        call): ``new_empty_strided(g, g.shape, strides)``, then ``copy_`` of ``g`` into it. The
        same values at the same layout, no data moved between ranks: not a deviation when the
        copy keeps ``g``'s placements. None: not such a call (the deviation stays)."""
        if target == _NEW_EMPTY_STRIDED:
            source = args[0]
            name = self.names.get(source)
            if name is None or tuple(args[1]) != tuple(source.shape):
                return None
            out = func(*args, **kwargs)
            self.layout_copies[out] = name
        elif target == _COPY:
            name = self.layout_copies.get(args[0])
            have, source = args[0], args[1]
            if name is None or self.names.get(source) != name:
                return None
            if not (isinstance(have, DTensor) and isinstance(source, DTensor)
                    and same_layout(tuple(have.placements), tuple(source.placements))):  # fmt: skip
                return None
            out = func(*args, **kwargs)
            self.names[out] = name
        else:
            return None
        self.deviations[-1:] = []  # the unmatched call is accounted for
        return out

    # -- running one call ---------------------------------------------------------------------
    def _run(self, step: AtenStep, func: Any, args: tuple, kwargs: dict) -> Any:
        tensors = leaves((args, kwargs), torch.Tensor)
        if len(tensors) != len(step.operands):
            self.deviations.append(f"{step.target}: {len(tensors)} tensors, traced with "
                                   f"{len(step.operands)}")  # fmt: skip
            return func(*args, **kwargs)
        inplace = func._schema.is_mutable
        tensors = [
            follow_calls.balanced(self, t, n) for t, n in zip(tensors, step.operands, strict=True)
        ]
        by_op = nn_local.interprets(self.plan, step)  # its ops move their own operands
        moved = [
            t
            if (inplace and i == 0) or name is None or _legacy_empty(t)
            else self._to(self._through_identities(t, name, step),
                          self._placements(None, name) if by_op else self._want(step, i), step)
            for i, (t, name) in enumerate(zip(tensors, step.operands, strict=True))
        ]  # fmt: skip
        if inplace and torch.Tag.inplace_view in func.tags and isinstance(args[0], DTensor):
            return follow_calls.in_place_view(self, step, func, args, kwargs)
        if (
            inplace
            and torch.Tag.inplace_view not in func.tags
            and follow_calls.relayout(self, step, args[0])
        ):
            out = follow_calls.run_out_of_place(self, step, func, (args, kwargs), tensors, moved)
            view_writes.write_back(self, step, tensors[0])
            return out
        args, kwargs = self._arguments(step, _replace((args, kwargs), iter(moved)))
        if step.target in _EMPTY and step.results[0] in self.fill_layout:
            return follow_calls.empty_at(
                self, func(*args, **kwargs), self.fill_layout[step.results[0]]
            )
        out = self._run_local(step, func, args, kwargs, moved)
        if out is None:
            self._check_internal(step)
            out = func(*args, **kwargs)
            if step.target.startswith("aten.arange") and self.order is not None:
                out = follow_calls.positions(self, out)
        if inplace:
            view_writes.write_back(self, step, tensors[0])
            return out
        return self._results(step, out)

    def _run_local(self, step: AtenStep, func: Any, args: tuple, kwargs: dict, moved: list) -> Any:
        """A call the follower runs itself (not through DTensor's dispatch); None: not one."""
        out = None
        if step.target.rsplit(".", 1)[0].removesuffix("_backward") in _ATTENTION:
            qkv = moved[1:4] if "backward" in step.target else moved[:3]
            out = follow_calls.attention(self, func, args, kwargs, qkv)
        elif step.target in follow_calls.MATMUL_ADD:
            out = follow_calls.matmul_add(self, step, args, kwargs)
        elif conv_local.handles(self.plan, step):  # local shards: groups per rank, halos
            out = conv_local.run(self, step, func, args, kwargs)
        elif step.target in VIEW_CALLS and (local := follow_calls.local_view(args)) is not None:
            out = local
        elif (
            step.target == _AS_STRIDED
            and (viewed := follow_calls.strided_reshape(args)) is not None
        ):
            out = viewed
        elif step.target in _FILLS_LIKE and not any(
            self.plan.graph.ops[i].operands for i in step.ops
        ):
            out = follow_calls.fill_at(self, func, args, kwargs, step)
        elif nn_local.handles([self.plan.graph.ops[i].kind for i in step.ops]):
            out = nn_local.run_step(self, step, func, args, kwargs, moved)
        elif bags.handles(step.target):  # pooled lookups on local shards
            out = bags.run_step(self, step, args)
        elif step.target in losses.LOCAL:
            out = losses.run_step(self, step, args, kwargs)
        elif step.target == _EMBEDDING and lookup.fits(*args[:2]):
            out = lookup.masked_lookup(args[1], args[0])[0]  # the project's, not DTensor's
        elif step.target in (_CLONE, follow_calls.CAT):
            out = follow_calls.local_copy(self, step, args, kwargs)
        return out

    def _arguments(self, step: AtenStep, call: tuple) -> tuple:
        """The moved ``(args, kwargs)`` as eager ``cat`` and DTensor's embedding take them."""
        args, kwargs = call
        if step.target == "aten.cat.default":
            args = (without_legacy_empty(args[0]), *args[1:])
        if (
            step.target == _EMBEDDING
            and isinstance(args[0], DTensor)
            and not lookup.fits(*args[:2])
        ):
            table = apply_mode.one_vocab_split(args[0])  # DTensor's mask: one vocabulary split
            if table is not args[0]:
                self.deviations.append(f"{step.target}: table gathered to {table.placements}")
                args = (table, *args[1:])
        return args, kwargs

    def _through_identities(self, t: torch.Tensor, name: str, step: AtenStep) -> torch.Tensor:
        """``t`` moved along the traced identity calls that lead to ``name``, each once.

        The trace may route a value through ``detach``/same-shape views the run does not make;
        the plan can reshard into those calls (an all-gather into a ``detach`` every later use
        reads), so the follower performs those reshards when the value is first used.
        """
        chain: list[str] = []
        while name in self.identity_of:
            chain.append(name)
            name = self.identity_of[name][0]
        for value in reversed(chain):
            made = self.made.get(value)
            if made is not None and self._made_from(made, t):
                t = made[2]
                continue
            operand, index = self.identity_of[value]
            source = t
            into = self.plan.operand_shardings.get((index, 0))
            t = self._to(t, self._placements(into, operand), step)
            t = self._to(t, self._placements(None, value), step)
            self.made[value] = (source, self.names.get(source), t)
        return t

    def _made_from(self, made: tuple[torch.Tensor, str | None, DTensor], t: torch.Tensor) -> bool:
        """``t`` holds what ``made`` was made from: the same tensor, or another run-time tensor
        of the same value at the same layout (autograd may hand a saved operand to the
        backward as a new tensor object: the router's input, gathered once, priced once)."""
        source, name, _ = made
        if source is t:
            return True
        return (
            name is not None
            and self.names.get(t) == name
            and isinstance(t, DTensor)
            and isinstance(source, DTensor)
            and tuple(t.placements) == tuple(source.placements)
        )

    def _want(self, step: AtenStep, leaf: int) -> Placements:
        """Planned layout of operand ``leaf``: how the step's IR ops consume that value."""
        name = step.operands[leaf]
        occurrence = step.operands[:leaf].count(name)
        for index in step.ops:
            for j, operand in enumerate(self.plan.graph.ops[index].operands):
                if operand.name == name:
                    if occurrence == 0:
                        into = self.plan.operand_shardings.get((index, j))
                        into = self._reduced_after(step, index, into or self.plan.shardings[name])
                        return self._placements(into, name)
                    occurrence -= 1
        return self._placements(None, name)

    def _reduced_after(self, step: AtenStep, index: int, into: Sharding) -> Sharding:
        """``into`` moved to the layout the plan gives IR op ``index``'s result inside the call,
        when that op is a reshape adding or dropping size-1 dims (``stack`` lowers to such
        reshapes and a concat): moving its operand is the same collective on the same bytes,
        and the call has no place to move it in between."""
        inside = self._internal_layout(step, index)
        if inside is None:
            return into
        op = self.plan.graph.ops[index]
        src, dst = op.operands[0].type.shape, op.results[0].type.shape
        axes = iter(a for a, n in zip(inside.dims, dst, strict=True) if n != 1)
        dims = tuple(() if n == 1 else next(axes) for n in src)
        return Sharding(dims, inside.partial)

    def _internal_layout(self, step: AtenStep, index: int) -> Sharding | None:
        """The layout IR op ``index``'s result (a reshape of size-1 dims) is read at by the next
        op of the same call, when that differs from the result's own; else None."""
        op = self.plan.graph.ops[index]
        if op.kind != "reshape":
            return None
        src, dst = op.operands[0].type.shape, op.results[0].type.shape
        if [n for n in src if n != 1] != [n for n in dst if n != 1]:
            return None
        made = self.plan.shardings[op.results[0].name]
        for k in step.ops:
            for j, operand in enumerate(self.plan.graph.ops[k].operands):
                into = self.plan.operand_shardings.get((k, j))
                if operand is op.results[0] and into is not None and into != made:
                    return into
        return None

    def _placements(self, sharding: Sharding | None, value: str | None) -> Placements:
        if sharding is None:
            sharding = self.plan.shardings[value]
        return placements_of(sharding, self.plan.mesh, value or "")

    def _to(self, t: torch.Tensor, want: Placements, step: AtenStep) -> DTensor:
        """``t`` as a DTensor at ``want`` (plain tensors are replicated: made on every rank)."""
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        have = tuple(t.placements)
        if same_layout(have, want):
            return t
        fixed = tuple(
            h if isinstance(w, Partial) and isinstance(h, (Shard, Replicate)) else w
            for h, w in zip(have, want, strict=True)
        )
        if fixed != want:  # DTensor cannot turn a shard or a whole value into a pending sum
            self.deviations.append(f"{step.target}: cannot move {have} to {want}")
        moved, as_priced = reshard.reshard(t, fixed, self.plan.mesh)
        if not as_priced:
            self.deviations.append(f"{step.target}: {have} -> {fixed} not as priced")
        return moved

    def _results(self, step: AtenStep, out: Any) -> Any:
        produced = leaves(out, torch.Tensor)
        moved = []
        for t, name in zip(produced, step.results, strict=False):
            if name is None:
                moved.append(t)
                continue
            want = self._placements(None, name)
            if isinstance(t, DTensor) and not same_layout(tuple(t.placements), want):
                self.deviations.append(
                    f"{step.target} -> %{name}: DTensor made {tuple(t.placements)}, plan {want}"
                )
            moved.append(self._to(t, want, step))
        moved += produced[len(moved) :]
        return _replace(out, iter(moved))

    def _check_internal(self, step: AtenStep) -> None:
        """A reshard between two IR ops of one aten call cannot be followed: report it."""
        made = {r.name for i in step.ops for r in self.plan.graph.ops[i].results}
        made -= {  # moved before the call instead (``_reduced_after``)
            self.plan.graph.ops[i].results[0].name
            for i in step.ops
            if self._internal_layout(step, i) is not None
        }
        for index in step.ops:
            for j, operand in enumerate(self.plan.graph.ops[index].operands):
                planned = self.plan.operand_shardings.get((index, j))
                if operand.name in made and planned not in (
                    None,
                    self.plan.shardings[operand.name],
                ):
                    self.deviations.append(f"{step.target}: internal reshard of %{operand.name}")

    def _wrap(self, local: torch.Tensor, placements: tuple) -> DTensor:
        """A DTensor of local shards at ``placements``, keeping the kernel's memory order (the
        CPU kernel returns [b,s,h,d]-ordered outputs; a later transpose then needs no copy, as
        in the trace)."""
        shape = list(local.shape)
        for axis, p in enumerate(placements):
            if isinstance(p, Shard):
                shape[p.dim] *= self.mesh.size(axis)
        stride = [0] * len(shape)
        step = 1
        for d in sorted(range(len(shape)), key=lambda d: (local.stride(d), d)):
            stride[d] = step
            step *= shape[d]
        return DTensor.from_local(local, self.mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=tuple(stride))  # fmt: skip


_EMPTY = frozenset({
    "aten.new_empty_strided.default", "aten.new_empty.default", "aten.empty_like.default",
    "aten.empty.memory_format", "aten.empty_strided.default",
})  # fmt: skip
"""Factories of uninitialised tensors: any layout is made without communication."""


def _legacy_empty(t: torch.Tensor) -> bool:
    """A ``torch.tensor([])`` (plain, or made replicated on the way): ``cat`` ignores it beside
    operands of any rank (Hugging Face's ``DynamicCache`` starts from one), so it has no layout
    to follow."""
    return t.shape == (0,)


def without_legacy_empty(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``cat``'s operands as eager ``cat`` uses them: 1-D empty ones skipped (all of them
    empty: the first is kept). DTensor's ``cat`` would reshard them to the others' layout."""
    kept = [t for t in tensors if not _legacy_empty(t)]
    return kept or list(tensors[:1])


def _replace(tree: Any, new: Iterator[Any]) -> Any:
    """``tree`` with its tensor leaves replaced, in ``leaves`` order, by ``new``."""
    if isinstance(tree, torch.Tensor):
        return next(new)
    if isinstance(tree, tuple):
        return tuple(_replace(x, new) for x in tree)
    if isinstance(tree, list):
        return [_replace(x, new) for x in tree]
    if isinstance(tree, dict):
        return {k: _replace(v, new) for k, v in tree.items()}
    return tree
