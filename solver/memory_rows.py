"""The memory model's CP-SAT rows: peak rows under the limit and per-layer recomputation
choices with their cost, for eliminated nodes through the live node they follow.

The budget is one linear row per *reduced time point* (XLA's MemoryTermReducer idea): only the
points where the live set is maximal are kept — for intervals, a point where some term ends
after some term started since the last end — so dropping the others loses nothing. Terms are
summed per node per time point with a difference array.

Recomputation is one 0/1 choice per layer and mode (``selective``/``full``, at most one): it
frees the layer's saved activations between its forward and its backward (window terms, priced
through an auxiliary ``q >= saved(x) - M * r``) and costs the recomputed forward ops' compute
(``f >= forward(x) - C * (1 - r)``, added to the objective); both auxiliaries are pushed to
their bound by the row or the objective, so the linearisation is exact for 0/1 values.
"""

from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING

import numpy as np

from .problem import Problem

if TYPE_CHECKING:
    from .memory import MemoryModel, Term

MEMORY_UNIT = 1 << 16
"""Memory rows count 64 KiB units: byte-sized coefficients (up to ~1e10 in rows summing to
~1e13) made CP-SAT's presolve declare feasible models infeasible (seen at 32 Llama-8B layers)."""


class MemoryRows:
    """Adds one model's memory rows to a CP-SAT model (resolving eliminated nodes)."""

    def __init__(self, memory: MemoryModel, model, problem: Problem, x: dict) -> None:
        self.memory, self.model, self.x = memory, model, x
        self.resolve = _resolution(problem)

    def vector(self, node: int, values: np.ndarray) -> tuple[int, np.ndarray]:
        """Bytes in ``MEMORY_UNIT`` units, rounded up (so a row that fits really fits)."""
        leader, mapping = self.resolve.get(node, (node, None))
        values = values if mapping is None else values[mapping]
        return leader, np.ceil(np.asarray(values, dtype=float) / MEMORY_UNIT).astype(np.int64)

    def _cost_expr(self, pairs: list[tuple[int, np.ndarray]]):
        """Like ``expr`` for objective-scaled costs (no memory units)."""
        total: dict[int, np.ndarray] = {}
        for node, vec in pairs:
            leader, mapping = self.resolve.get(node, (node, None))
            v = (vec if mapping is None else vec[mapping]).astype(np.int64)
            total[leader] = total[leader] + v if leader in total else v
        return self._linear_total(total)

    def expr(self, pairs: list[tuple[int, np.ndarray]]):
        """Linear expression of sum_n vec_n[s_n] (per-node minima become constants)."""
        total: dict[int, np.ndarray] = {}
        for node, vec in pairs:
            leader, v = self.vector(node, vec)
            total[leader] = total[leader] + v if leader in total else v.astype(np.int64)
        return self._linear_total(total)

    def _linear_total(self, total: dict[int, np.ndarray]):
        """(expression, upper bound) of sum_n total[n][s_n]; per-node minima become constants."""
        constant, parts = 0, []
        for n, vec in total.items():
            base = int(vec.min())
            constant += base
            if len(self.x[n]) > 1:
                parts += [
                    int(c - base) * var for var, c in zip(self.x[n], vec, strict=True) if c > base
                ]
        return constant + _sum(parts), constant + sum(
            int(v.max() - v.min()) for v in total.values()
        )

    def build(self, limit, terms: list | None, scale: float) -> dict:
        mem = self.memory
        r_vars = self._recompute_vars(terms, scale)
        fixed, windows = [], {}
        for t in mem.terms:
            if t.freed_by is not None and mem.allow_recompute:
                windows.setdefault(t.freed_by, []).append(t)
            else:
                fixed.append(t)
        if mem.forced is None:
            for outer, inner in alike_pairs(mem, windows, self):  # symmetry breaking (exact)
                full_o, full_i = r_vars[(outer, "full")], r_vars[(inner, "full")]
                sel_o, sel_i = r_vars[(outer, "selective")], r_vars[(inner, "selective")]
                self.model.Add(full_o >= full_i)
                self.model.Add(full_o + sel_o >= full_i + sel_i)
        q_terms = []
        for (layer, cls), group in sorted(windows.items()):
            expr, bound = self.expr([(t.node, t.nbytes) for t in group])
            q = self.model.NewIntVar(0, max(bound, 0), f"q_{layer}_{cls}")
            freeing = [r_vars[(layer, "full")]]
            if cls == "selective":
                freeing.append(r_vars[(layer, "selective")])
            self.model.Add(q >= expr - bound * sum(freeing))
            q_terms.append((group[0].start, group[0].stop, q))
        intervals = [(t.start, t.stop) for t in fixed] + [(a, b) for a, b, _ in q_terms]
        kept = reduced_time_points(intervals, mem.live.end)
        rows = _rows(fixed, kept, self)
        for lo, hi, q in q_terms:
            for k in _kept_range(kept, lo, hi):
                rows[k].append(q)
        bound = limit // MEMORY_UNIT if isinstance(limit, int) else limit  # int: a byte budget
        for row in rows:
            self.model.Add(_sum(row) <= bound)
        return r_vars

    def _recompute_vars(self, terms: list | None, scale: float) -> dict:
        mem, r_vars = self.memory, {}
        if not mem.allow_recompute:
            return r_vars
        for layer in mem.live.layers:
            pair = {m: self.model.NewBoolVar(f"r_{layer}_{m}") for m in ("selective", "full")}
            self.model.Add(sum(pair.values()) <= 1)
            # CP-SAT only runs when the LP's layouts do not fit: start from the choice that
            # frees the most memory, so a feasible point is at hand (it then trades back).
            # A seed (the best fitting hand-written strategy, ``planner._seed``) brings its own.
            seeded = mem.hint_decisions.get(layer, "full") if mem.hint_decisions else "full"
            self.model.AddHint(pair["full"], int(seeded == "full"))
            self.model.AddHint(pair["selective"], int(seeded == "selective"))
            if mem.forced is not None:
                wanted = mem.forced.get(layer)
                for m, var in pair.items():
                    self.model.Add(var == int(m == wanted))
            for m, var in pair.items():
                r_vars[(layer, m)] = var
                ops = mem.recompute_ops.get((layer, m), [])
                if terms is None or not ops:
                    continue
                scaled = [(n, np.round(v * scale).astype(np.int64)) for n, v in ops]
                expr, bound = self._cost_expr(scaled)
                f = self.model.NewIntVar(0, max(bound, 0), f"f_{layer}_{m}")
                self.model.Add(f >= expr).OnlyEnforceIf(var)  # the forward again, if recomputed
                terms.append((f, 1))
        return r_vars


def alike_pairs(memory: MemoryModel, windows: dict, builder: MemoryRows) -> list[tuple[str, str]]:
    """(outer, inner) layer pairs whose recomputation may be ordered without losing the optimum.

    Two layers are alike when recomputing either in a mode frees the same bytes (window terms on
    the same solver nodes, which repeated layers share) and re-runs ops of the same cost. If the
    outer layer's window (forward end to backward start) contains the inner one's, giving the
    outer layer the inner one's mode and vice versa costs the same and frees at least as much
    at every time point, since ``full`` frees all that ``selective`` does. So some optimum
    recomputes outer layers at least as much as inner ones: ``full_o >= full_i`` and
    ``full_o + sel_o >= full_i + sel_i``. Without these rows CP-SAT explores every permutation
    of which alike layers recompute (2 x 80 Booleans on Llama-3-70B)."""
    if not memory.allow_recompute:
        return []
    groups: dict[tuple, list[str]] = {}
    for name, layer in memory.live.layers.items():
        if layer.forward_end + 1 > layer.backward_start - 1:
            continue  # no window: recomputing it frees nothing
        key = []
        for cls in ("selective", "full"):
            vecs = sorted(
                _signature(builder, t.node, t.nbytes) for t in windows.get((name, cls), ())
            )
            key.append(tuple(vecs))
        for mode in ("selective", "full"):
            ops = memory.recompute_ops.get((name, mode), [])
            key.append(tuple(sorted(_signature(builder, n, v) for n, v in ops)))
        groups.setdefault(tuple(key), []).append(name)
    pairs = []
    for names in groups.values():
        spans = sorted(
            (memory.live.layers[n].forward_end, memory.live.layers[n].backward_start, n)
            for n in names
        )
        for (fe_o, bs_o, outer), (fe_i, bs_i, inner) in itertools.pairwise(spans):
            if fe_o < fe_i and bs_i < bs_o:
                pairs.append((outer, inner))
    return pairs


def _signature(builder: MemoryRows, node: int, values: np.ndarray) -> tuple[int, bytes]:
    leader, mapping = builder.resolve.get(node, (node, None))
    vec = np.asarray(values if mapping is None else values[mapping])
    return leader, vec.tobytes()


def _rows(fixed: list[Term], kept: list[int], builder: MemoryRows) -> list[list]:
    """Per kept time point, the linear terms of every unconditional term live there.

    Deltas are sparse per node (a dense array per node and point was most of a 96-layer
    model's planning time); the rows and their order are those of a dense sweep."""
    diff: dict[int, dict[int, np.ndarray]] = {}
    for t in fixed:
        ks = _kept_range(kept, t.start, t.stop)
        if not ks:
            continue
        node, vec = builder.vector(t.node, t.nbytes)
        deltas = diff.setdefault(node, {})
        for k, sign in ((ks.start, 1), (ks.stop, -1)):
            deltas[k] = deltas[k] + sign * vec if k in deltas else sign * vec.astype(np.int64)
    rows: list[list] = [[] for _ in kept]
    for node, deltas in sorted(diff.items()):
        points = sorted(deltas)
        acc = np.zeros_like(deltas[points[0]])
        for a, b in zip(points, [*points[1:], len(kept)], strict=True):
            acc = acc + deltas[a]
            if acc.any():
                term = _linear(builder, node, acc)  # one expression serves every point
                for k in range(a, min(b, len(kept))):
                    rows[k].append(term)
    return rows


def _linear(builder: MemoryRows, node: int, vec: np.ndarray):
    base = int(vec.min())
    vars_ = builder.x[node]
    if len(vars_) == 1:
        return int(vec[0])
    keep = np.nonzero(vec > base)[0]
    return _weighted([vars_[i] for i in keep], [int(vec[i] - base) for i in keep], base)


def _sum(parts: list):  # type: ignore[no-untyped-def]
    """One flat CP-SAT sum (Python's ``sum`` nests one node per term: a 21,132-row model of
    ~57 terms each spent 20 s there on Llama-3-70B)."""
    from ortools.sat.python import cp_model  # loaded already: a model is being built

    return cp_model.LinearExpr.sum(parts)


def _weighted(vars_: list, coefs: list[int], constant: int):  # type: ignore[no-untyped-def]
    from ortools.sat.python import cp_model

    return cp_model.LinearExpr.weighted_sum(vars_, coefs) + constant


def _kept_range(kept: list[int], lo: int, hi: int) -> range:
    return range(bisect.bisect_left(kept, lo), bisect.bisect_right(kept, hi))


def reduced_time_points(intervals: list[tuple[int, int]], end: int) -> list[int]:
    """Time points whose live set is maximal: an interval ends there after one started.

    For closed intervals these are exactly the maximal cliques of the interval graph, so a
    peak over them equals the peak over all points (every other live set is a subset).
    """
    starts, stops = [0] * (end + 2), [0] * (end + 2)
    for lo, hi in intervals:
        if lo <= hi:
            starts[max(lo, 0)] += 1
            stops[min(hi, end)] += 1
    kept, opened = [], False
    for t in range(end + 1):
        opened = opened or starts[t] > 0
        if opened and (stops[t] > 0 or t == end):
            kept.append(t)
            opened = False
    return kept


def _resolution(problem: Problem) -> dict[int, tuple[int, np.ndarray]]:
    """Eliminated node -> (live node, live strategy -> its strategy)."""
    out: dict[int, tuple[int, np.ndarray]] = {}
    for f, ld, mapping in reversed(problem.eliminated):
        if ld in out:
            leader, inner = out[ld]
            out[f] = (leader, mapping[inner])
        else:
            out[f] = (ld, mapping)
    return out
