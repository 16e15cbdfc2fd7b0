"""Matching each run-time call of a followed step to the traced call it replays: the next call
with its target whose operands hold the same IR values (a few may be skipped), gradient sums
autograd adds up in another order, and the traced calls the run never made."""

from __future__ import annotations

import dataclasses
import math

import torch

from .capture import IDENTITY_CALLS, VIEW_CALLS, AtenStep, is_identity

ADD = "aten.add.Tensor"
VIEW = "aten.view.default"
COPIED_RESHAPE = ("aten.clone.default", "aten._unsafe_view.default")
"""How ``reshape`` runs where it cannot view its input: a copy, then a view of the copy."""
LOOKAHEAD = 64
"""How many captured calls a run-time call may skip to find its match."""


class TraceMatcher:
    """Where a run is in the traced calls (``follow.PlanFollower`` asks it for each call)."""

    def __init__(
        self,
        steps: list[AtenStep],
        same: dict[str, str],
        empty: set[str],
        deviations: list[str],
        shapes: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.steps = steps
        self.shapes = shapes or {}
        """IR value -> its shape: a run-time DTensor operand of unknown value matches a traced
        one only at the same global shape (eager autograd sums a 3-D bias gradient where the
        trace viewed it to 2-D first; naming that sum after the traced one would relayout the
        wrong dims)."""
        self._call_shapes: list[tuple[int, ...] | None] | None = None
        self.same = same
        """Result of a traced identity call -> the value it passes on (one name for matching)."""
        self.empty = empty
        """Values that are a legacy ``torch.tensor([])`` (a ``cat`` operand eager ``cat`` skips)."""
        self.deviations = deviations
        """The follower's list: calls not in the trace and traced calls not run are added."""
        self.cursor = 0
        self.skipped: dict[int, AtenStep] = {}
        """Traced calls passed over by a later match, by index: the run may still make them."""
        self.sum_terms: dict[str, tuple[str, ...]] = {}
        """Result of a traced (or run-time) ``add`` -> the leaf values it sums."""
        self.sums: dict[tuple[str, ...], int] = {}
        """Sorted terms -> index of the traced ``add`` making that sum."""
        for k, s in enumerate(steps):
            if s.target == ADD and len(s.operands) == 2 and s.results and s.results[0]:
                terms = tuple(t for o in s.operands for t in self._terms(o or "?"))
                self.sum_terms[s.results[0]] = terms
                self.sums.setdefault(tuple(sorted(terms)), k)

    def match(
        self,
        target: str,
        known: list[str | None],
        shapes: list[tuple[int, ...] | None] | None = None,
    ) -> AtenStep | None:
        """The next traced call with this target whose operands agree with the values the
        run-time operands are known to hold (and, for those of unknown value, with their global
        ``shapes`` where given); calls skipped on the way are reported."""
        self._call_shapes = shapes
        for k, step in list(self.skipped.items()):  # autograd may run ready nodes in
            fit = self._fit(step, target, known)  # another order
            if fit is not None:
                del self.skipped[k]
                return fit
        end = min(self.cursor + LOOKAHEAD, len(self.steps))
        for k in range(self.cursor, end):
            fit = self._fit(self.steps[k], target, known)
            if fit is not None:
                self.skipped.update((j, self.steps[j]) for j in range(self.cursor, k))
                self.cursor = k + 1
                return fit
        self.deviations.append(f"call not in the trace: {target}")
        return None

    def _fit(self, step: AtenStep, target: str, known: list[str | None]) -> AtenStep | None:
        """``step`` if the call matches it; a traced ``cat`` also matches without its legacy
        empty operands (``apply``'s ``cat`` rule drops them before dispatch, as eager ``cat``
        ignores them), as a step of the operands left."""
        if step.target != target:
            return None
        if self._agree(step.operands, known):
            return step
        if target == "aten.cat.default" and len(known) < len(step.operands):
            kept = tuple(o for o in step.operands if o not in self.empty)
            if self._agree(kept, known):
                return dataclasses.replace(step, operands=kept)
        return None

    def match_copied_reshape(self, known: list[str | None]) -> tuple[AtenStep, AtenStep] | None:
        """A run-time ``view`` where the trace's ``reshape`` copied (``COPIED_RESHAPE``):
        DTensor's strides allowed the view the eager strides did not (the same values). The
        traced pair replaces the view; the unmatched view is accounted for. None: no pair."""
        end = min(self.cursor + LOOKAHEAD, len(self.steps) - 1)
        for k in range(self.cursor, end):
            copy, view = self.steps[k], self.steps[k + 1]
            if (copy.target, view.target) != COPIED_RESHAPE or not copy.results:
                continue
            if self._agree(copy.operands, known) and view.operands[:1] == copy.results[:1]:
                self.skipped.update((j, self.steps[j]) for j in range(self.cursor, k))
                self.cursor = k + 2
                self.deviations[-1:] = []  # the unmatched view
                return copy, view
        return None

    def _terms(self, name: str) -> tuple[str, ...]:
        return self.sum_terms.get(name, (name,))

    def match_sum(self, known: list[str | None]) -> AtenStep | None:
        """A gradient sum added up in another order than the trace: autograd accumulates a
        value's gradients as they arrive (``(g1 + g2) + g3`` where the trace has
        ``(g2 + g3) + g1``). The traced ``add`` whose result sums the same terms is taken."""
        if None in known:
            return None
        terms = tuple(sorted(t for k in known for t in self._terms(k or "")))
        index = self.sums.get(terms)
        if index is None:
            return None
        if index in self.skipped:
            return self.skipped.pop(index)
        if index < self.cursor:
            return None
        self.skipped.update((j, self.steps[j]) for j in range(self.cursor, index))
        self.cursor = index + 1
        return self.steps[index]

    def partial_sum(self, known: list[str | None]) -> str:
        """A name for a run-time sum the trace never made (its terms are remembered)."""
        name = "+".join(t for k in known for t in self._terms(k or ""))
        self.sum_terms[name] = tuple(t for k in known for t in self._terms(k or ""))
        self.deviations[-1:] = []  # the unmatched add is accounted for by the later total
        return name

    def finish(self) -> None:
        """Report the traced calls the run never made."""
        for step in self.skipped.values():
            if step.results and set(step.results) <= self.empty:
                continue  # a gradient of a skipped legacy empty ``cat`` operand
            self.deviations.append(f"traced call not run: {step.target}")
        self.skipped.clear()

    def _agree(self, traced: tuple[str | None, ...], known: list[str | None]) -> bool:
        same, shapes = self.same, self._call_shapes
        if len(traced) != len(known):
            return False
        if shapes is not None and any(
            k is None and s is not None and t in self.shapes and self.shapes[t] != s
            for t, k, s in zip(traced, known, shapes, strict=True)
        ):
            return False
        return all(
            k is None or same.get(k, k) == same.get(t or "", t)
            for t, k in zip(traced, known, strict=True)
        )


def in_place_target(target: str) -> bool:
    """``aten.copy_.default``, ``aten.add_.Tensor``: the op name ends in one underscore."""
    name = target.split(".")[1] if target.count(".") >= 1 else target
    return name.endswith("_") and not name.endswith("__")


def identity_call(target: str, args: tuple) -> bool:
    """An identity call (``capture.is_identity``) judged from its run-time arguments."""
    if target in IDENTITY_CALLS:
        return True
    if target not in VIEW_CALLS or not isinstance(args[0], torch.Tensor):
        return False
    shape = [int(d) for d in args[1]]
    if -1 in shape:  # resolve the inferred size as view does
        known = math.prod(d for d in shape if d != -1)
        shape[shape.index(-1)] = args[0].numel() // max(known, 1)
    return is_identity(target, tuple(args[0].shape), tuple(shape))
