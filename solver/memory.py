"""Memory of a training step as solver terms: peak-memory constraints and recomputation choices.

Every value contributes a *term*: bytes per strategy of one decision node, live over an interval
of op indices (``passes/liveness.py``). A graph input is held in its own layout all step. An op
result is kept in the layout its *last reader* consumes it in — a partial gradient reduced
right away into the layout of the update that reads it (DDP keeps it whole, ZeRO-2 keeps a
shard), a forward activation in the layout its backward use wants. Copies made for one op only
(an all-gather before a matmul) are transient and not counted.

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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from ..costmodel.cluster import Cluster
from ..costmodel.memory import MemoryItem, MemoryProfile, gib, memory_profile
from ..ir import InfeasiblePlanError, Role, Value
from ..ir.op_cost import IN_PLACE_WRITES, VIEW_KINDS
from ..passes.liveness import Liveness, Phase, liveness
from .costs import Space, op_cost
from .problem import Problem

if TYPE_CHECKING:  # imported where a search runs (solver/ilp.py: it pulls in pandas)
    from ortools.sat.python import cp_model

MEMORY_UNIT = 1 << 16
"""Memory rows count 64 KiB units: byte-sized coefficients (up to ~1e10 in rows summing to
~1e13) made CP-SAT's presolve declare feasible models infeasible (seen at 32 Llama-8B layers)."""

INPUT_CATEGORY = {
    Role.PARAMETER: "parameters", Role.OPTIMIZER_STATE: "optimizer_states",
    Role.KV_CACHE: "kv_cache",
}  # fmt: skip


SCAN_SLICES = ("scan_index", "scan_stack")


def cache_write(value: Value) -> bool:
    """Whether ``value`` is a KV cache written in place (``index_copy`` or XLA's
    ``dynamic_update_slice`` into a ``KV_CACHE`` input): it lives in the input's buffer, which
    is counted once, as ``kv_cache``. A scanned decoder's cache reaches the write through the
    scan's slice of the stacked cache and comes back stacked (``scan_index``/``scan_stack``):
    the stacked result is the donated input's buffer too."""
    op = value.producer
    while op is not None and (op.kind in IN_PLACE_WRITES or op.kind in SCAN_SLICES):
        value = op.operands[0]
        op = value.producer
    return op is None and value.role is Role.KV_CACHE and value.producer is None


@dataclass(frozen=True, slots=True)
class Term:
    """``nbytes[s]`` per device while node ``node`` takes strategy ``s``, over [start, stop]."""

    label: str
    category: str
    start: int
    stop: int
    node: int
    nbytes: np.ndarray
    freed_by: tuple[str, str] | None = None
    """(layer, mode class): recomputing that layer in that mode (or ``full``) drops the term."""


def frees(decision: str | None, mode_class: str) -> bool:
    """Whether a layer recomputed with ``decision`` frees values of ``mode_class``."""
    return decision == "full" or (decision == "selective" and mode_class == "selective")


@dataclass(eq=False)
class LagrangeTrace:
    """What the Lagrangian bound (``solver/lagrange.py``) learnt on one memory model's
    problems, for the next call and for the primal heuristic (``solver/recompute.py``)."""

    multipliers: dict[int, float] = field(default_factory=dict)
    """Time point -> the multiplier that gave its best bound (0: none raised it); the
    planner's variants of one solve share the model and differ little."""
    points: list[list[int]] = field(default_factory=list)
    """Each distinct LP minimiser's layouts (one strategy per node), in the order found."""
    seen: set[tuple[int, ...]] = field(default_factory=set)

    def remember(self, choice: list[int]) -> None:
        key = tuple(choice)
        if key not in self.seen:
            self.seen.add(key)
            self.points.append(list(choice))


@dataclass(eq=False)
class MemoryModel:
    """The memory side of one planning problem (built once, read by the ILP and the Plan)."""

    space: Space
    live: Liveness
    terms: list[Term]
    limit: float | None
    recompute_ops: dict[tuple[str, str], list[tuple[int, np.ndarray]]]
    """(layer, mode) -> (node, compute seconds per strategy) of the ops it re-runs."""
    forced: dict[str, str | None] | None = None
    """Layer -> fixed decision (hand-written strategies); None lets the solver choose."""
    allow_recompute: bool = True
    decisions: dict[str, str] = field(default_factory=dict)
    """Layer -> mode of the last solution (empty: nothing recomputed)."""
    hint_decisions: dict[str, str] | None = None
    """Layer -> mode of a warm start (the seed's recomputation); None: hint full everywhere."""
    derived: dict = field(default_factory=dict, repr=False)
    """What depends only on ``terms`` (the peak table, the worst-case peak), computed once:
    ``dataclasses.replace`` copies share it, so the seed's forced models (``solver/seed.py``)
    do not rebuild it per strategy (0.1-0.4 s each on Llama-3-70B)."""
    lagrange: LagrangeTrace = field(default_factory=LagrangeTrace, init=False, repr=False)
    """What the Lagrangian bound found on this model's problems (``solver/lagrange.py``); a
    ``replace`` copy starts empty."""

    # -- exact evaluation ------------------------------------------------------------------
    def items(self, choice: list[int], decisions: dict[str, str] | None = None) -> list:
        decisions = self.decisions if decisions is None else decisions
        out = []
        for t in self.terms:
            if t.freed_by is not None and frees(decisions.get(t.freed_by[0]), t.freed_by[1]):
                continue
            out.append(
                MemoryItem(t.label, t.category, t.start, t.stop, int(t.nbytes[choice[t.node]]))
            )
        return out

    def profile(self, choice: list[int], decisions: dict[str, str] | None = None) -> MemoryProfile:
        return memory_profile(self.items(choice, decisions), self.live.end)

    def peak(self, choice: list[int], decisions: dict[str, str] | None = None) -> tuple[int, int]:
        """``(profile.peak, profile.peak_time)`` without building the items (numpy): the
        memory-bound path asks for it 20-30 times per plan (6-12 s of 70B's as ``profile``)."""
        return self.peaks(choice)(self.decisions if decisions is None else decisions)

    def peaks(self, choice: list[int]):  # type: ignore[no-untyped-def]
        """``decisions -> peak(choice, decisions)`` with the choice's bytes looked up once (the
        recomputation heuristic, ``solver/recompute.py``, asks for dozens per layout)."""
        table = self._peak_table()
        chosen = table.nbytes[table.rows, np.asarray(choice, dtype=np.int64)[table.nodes]]
        size = self.live.end + 2

        def peak(decisions: dict[str, str]) -> tuple[int, int]:
            values = chosen
            dropped = [index for (layer, cls), index in table.freed.items()
                       if frees(decisions.get(layer), cls)]  # fmt: skip
            if dropped:
                values = chosen.copy()
                values[np.concatenate(dropped)] = 0
            # float64 bins are exact here: every partial sum is far below 2**53 bytes
            weights = values.astype(np.float64)
            delta = np.bincount(table.starts, weights, size) - np.bincount(
                table.stops + 1, weights, size
            )
            live = np.cumsum(delta.astype(np.int64)[: self.live.end + 1])
            if len(live) == 0 or live.max() <= 0:
                return 0, 0
            at = int(np.argmax(live))  # the first maximum: ties go to the earliest point
            return int(live[at]), at

        return peak

    def _peak_table(self) -> _PeakTable:
        table = self.derived.get("peak_table")
        if table is None or table.terms is not self.terms:
            table = self.derived["peak_table"] = _PeakTable.of(self.terms, self.live.end)
        return table

    def _worst_peak(self) -> int:
        """The peak with every term at its largest (at the point where those sum highest)."""
        worst = self.derived.get("worst_peak")
        if worst is None or worst[0] is not self.terms:
            items = [MemoryItem(t.label, t.category, t.start, t.stop, int(t.nbytes.max()))
                     for t in self.terms]  # fmt: skip
            worst = self.derived["worst_peak"] = (
                self.terms,
                memory_profile(items, self.live.end).peak,
            )
        return worst[1]

    def fixed_decisions(self) -> dict[str, str]:
        return {k: v for k, v in (self.forced or {}).items() if v}

    def cannot_bind(self, problem: Problem) -> bool:
        """True when no choice can reach the limit: neither the peak (every term at its
        largest, at the time point where those maxima sum highest) nor the row of persistent
        inputs (``problem.memory``; the terms hold the inputs too, so the two are separate
        bounds, not a sum). The peak rows are then redundant and recomputing only adds time,
        so the solver may leave both out (exact). Forced recomputation keeps the model.

        Summing every term at once and adding the inputs again called a Llama-3-8B decode
        step on tp=8 (50 GB at most of an 80 GB device) memory-bound: the step was then solved
        only with followers merged, whose greedy layouts cost 13% more than the exact
        optimum (docs/design.md, "Planning speed")."""
        if self.limit is None or self.fixed_decisions():
            return False
        inputs = 0.0
        if problem.memory is not None:
            inputs = sum(float(problem.memory[n].max()) for n in problem.live_nodes())
        return max(self._worst_peak(), inputs) <= self.limit

    def fits(self, choice: list[int]) -> bool:
        """Whether a full choice without solver-chosen recomputation fits the limit."""
        if self.limit is None:
            return True
        return self.peak(choice, self.fixed_decisions())[0] <= self.limit

    def recompute_cost(self, choice: list[int], decisions: dict[str, str] | None = None) -> float:
        decisions = self.decisions if decisions is None else decisions
        return sum(
            float(vec[choice[n]])
            for layer, mode in decisions.items()
            for n, vec in self.recompute_ops.get((layer, mode), [])
        )

    # -- CP-SAT ----------------------------------------------------------------------------
    def add_to_cpsat(self, model, problem: Problem, x: dict, terms: list, scale: float) -> None:
        """Peak rows under ``self.limit`` and recomputation variables with their cost."""
        self._vars: dict = {}
        if self.limit is None and not self.forced:
            return
        self._vars = _Builder(self, model, problem, x).build(int(self.limit or 2**62), terms, scale)

    def read(self, solver: cp_model.CpSolver | None) -> None:
        """Record the recomputation decisions of a CP-SAT solution (None: the LP's, none)."""
        if solver is None or not getattr(self, "_vars", None):
            self.decisions = self.fixed_decisions()
            return
        self.decisions = {
            layer: mode for (layer, mode), var in self._vars.items() if solver.Value(var)
        }

    def minimum(
        self, problem: Problem, time_limit: float = 10.0
    ) -> tuple[int, list[int], dict] | None:
        """The smallest modelled peak any choice reaches (recomputing allowed), and the choice;
        None when CP-SAT finds no choice within ``time_limit``."""
        from ortools.sat.python import cp_model

        model = cp_model.CpModel()
        x = {}
        for n in problem.live_nodes():
            x[n] = [model.NewBoolVar("") for _ in problem.node_costs[n]]
            model.AddExactlyOne(x[n])
        peak = model.NewIntVar(0, 2**50, "peak")
        self._vars = _Builder(self, model, problem, x).build(peak, None, 1.0)
        model.Minimize(peak)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit
        solver.parameters.num_workers = 1
        status = solver.Solve(model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        choice = [0] * len(problem.node_costs)
        for n, vars_ in x.items():
            choice[n] = next(s for s, v in enumerate(vars_) if solver.Value(v))
        self.read(solver)
        full = problem.expand(choice)
        return self.profile(full).peak, full, dict(self.decisions)


@dataclass(eq=False)
class _PeakTable:
    """The terms as arrays (``MemoryModel.peak``): bytes per term and strategy (padded), node,
    clipped interval, and which terms each (layer, mode class) frees."""

    terms: list[Term]
    nbytes: np.ndarray
    rows: np.ndarray
    nodes: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    freed: dict[tuple[str, str], np.ndarray]

    @classmethod
    def of(cls, terms: list[Term], end: int) -> _PeakTable:
        kept = [i for i, t in enumerate(terms) if t.start <= t.stop]  # empty intervals: none
        width = max((len(terms[i].nbytes) for i in kept), default=1)
        nbytes = np.zeros((len(kept), width), dtype=np.int64)
        freed: dict[tuple[str, str], list[int]] = {}
        for row, i in enumerate(kept):
            t = terms[i]
            nbytes[row, : len(t.nbytes)] = [int(v) for v in t.nbytes]  # as MemoryItem: int()
            if t.freed_by is not None:
                freed.setdefault(t.freed_by, []).append(row)
        pick = [terms[i] for i in kept]
        return cls(
            terms,
            nbytes,
            np.arange(len(kept)),
            np.array([t.node for t in pick], dtype=np.int64),
            np.array([max(t.start, 0) for t in pick], dtype=np.int64),
            np.array([min(t.stop, end) for t in pick], dtype=np.int64),
            {k: np.array(v, dtype=np.int64) for k, v in freed.items()},
        )


class _Builder:
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


def alike_pairs(memory: MemoryModel, windows: dict, builder: _Builder) -> list[tuple[str, str]]:
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


def _signature(builder: _Builder, node: int, values: np.ndarray) -> tuple[int, bytes]:
    leader, mapping = builder.resolve.get(node, (node, None))
    vec = np.asarray(values if mapping is None else values[mapping])
    return leader, vec.tobytes()


def _rows(fixed: list[Term], kept: list[int], builder: _Builder) -> list[list]:
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


def _linear(builder: _Builder, node: int, vec: np.ndarray):
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


# -- building the terms of a graph ----------------------------------------------------------------
def build_memory_model(
    space: Space,
    cluster: Cluster,
    limit: float | None,
    recompute: bool | dict[str, str | None] = True,
    activation_scale: float = 1.0,
) -> MemoryModel:
    """Terms of every value plus the per-layer recomputation costs.

    Args:
      recompute: True lets the solver choose per layer; False forbids recomputation; a dict
        fixes the decision of each layer (``{"layers.0": "full"}``; missing layers: none).
      activation_scale: factor on activation terms; a pipeline's sub-mesh solve passes
        in-flight micro-batches / micro-batches (a stage holds that share of its activations).
    """
    live = liveness(space.graph)
    terms: list[Term] = []
    cache: dict = {}
    for n, value in enumerate(space.graph.inputs):
        vec = _bytes(space, n, "results", 0, value, cache)
        category = INPUT_CATEGORY.get(value.role, "inputs")
        terms.append(Term(f"%{value.name}", category, 0, live.end, n, vec))
    freed = _freed_classes(live)
    for i, op in enumerate(space.graph.ops):
        for k, value in enumerate(op.results):
            term = _result_term(space, live, i, k, value, cache)
            if term is not None and term.category == "activations" and activation_scale != 1.0:
                term = replace(term, nbytes=np.ceil(term.nbytes * activation_scale))
            if term is not None:
                terms += _split(term, freed.get(value), live)
    forced = recompute if isinstance(recompute, dict) else None
    allow = recompute is not False
    costs = _recompute_costs(space, cluster, live) if allow else {}
    return MemoryModel(space, live, terms, limit, costs, forced, allow)


def _bytes(space: Space, node: int, side: str, slot: int, value: Value, cache: dict) -> np.ndarray:
    strategies = space.strategies[node]
    key = (id(strategies), side, slot, value.type)
    if key not in cache:
        mesh, nbytes = space.mesh, value.type.nbytes
        cache[key] = np.array(
            [nbytes // getattr(s, side)[slot].shard_count(mesh) for s in strategies], dtype=np.int64
        )
    return cache[key]


def _result_term(space: Space, live: Liveness, i: int, k: int, value: Value, cache) -> Term | None:
    """Kept in the layout of its last reader (a partial gradient is reduced into the update's
    layout); a parameter copy and an unread loss in the produced layout (FSDP gathers a
    copy per use: that traffic is on the edges, the buffer is transient)."""
    if cache_write(value):
        return None
    serving, outputs = _graph_facts(space, cache)
    category = _category(value, live, i)
    if category == "parameter_copies" and serving:
        # a serving step has no backward to keep weights for: a view of a weight aliases it,
        # any other copy (a gathered weight) lives until its last reader, like an activation
        if value.producer is not None and value.producer.kind in VIEW_KINDS:
            return None
        category = "activations"
    start, stop = live.define[value], live.last_use[value]
    if value in live.last_reader and category != "parameter_copies":
        reader, slot = live.last_reader[value]
        node = space.op_node(reader)
        return Term(f"%{value.name}", category, start, stop, node,
                    _bytes(space, node, "operands", slot, value, cache))  # fmt: skip
    if category == "parameter_copies" or id(value) in outputs:
        node = space.op_node(i)
        return Term(f"%{value.name}", category, start, live.end, node,
                    _bytes(space, node, "results", k, value, cache))  # fmt: skip
    return None


def _graph_facts(space: Space, cache: dict) -> tuple[bool, set[int]]:
    """(whether the graph is a serving step: it has a KV cache, the ids of its outputs that
    alias no input), worked out once per model (per result they were 11 of 70B's 16 s of
    building the memory model under cProfile)."""
    facts = cache.get("graph_facts")
    if facts is None:
        graph = space.graph
        serving = any(v.role is Role.KV_CACHE for v in graph.inputs)
        outputs = {id(v) for j, v in enumerate(graph.outputs) if j not in graph.output_aliases}
        facts = cache["graph_facts"] = (serving, outputs)
    return facts


def _category(value: Value, live: Liveness, i: int) -> str:
    phase = live.phase[i]
    if phase is Phase.UPDATE:
        return "update"
    if phase is Phase.BACKWARD:
        return "gradients" if _read_by_update(value, live) else "activations"
    operands = [v for v in value.producer.operands if v.type.numel > 1]  # type: ignore[union-attr]
    if operands and all(_parameter_derived(v) for v in operands):
        return "parameter_copies"
    return "activations"


def _read_by_update(value: Value, live: Liveness) -> bool:
    reader = live.last_reader.get(value)
    return reader is not None and live.phase[reader[0]] is Phase.UPDATE


def _parameter_derived(value: Value) -> bool:
    while value.producer is not None and len(value.producer.operands) == 1:
        value = value.producer.operands[0]
    return value.producer is None and value.role is Role.PARAMETER


def _freed_classes(live: Liveness) -> dict[Value, tuple[str, str, int, int]]:
    """Saved value -> (layer, mode class, forward end, backward start)."""
    out: dict[Value, tuple[str, str, int, int]] = {}
    for name, layer in live.layers.items():
        selective = set(layer.saved["selective"])
        for v in layer.saved["full"]:
            cls = "selective" if v in selective else "full"
            out[v] = (name, cls, layer.forward_end, layer.backward_start)
    return out


def _split(term: Term, freed, live: Liveness) -> list[Term]:
    """A saved value: live in forward, free in its layer's window if recomputed, live again."""
    if freed is None:
        return [term]
    layer, cls, fe, bs = freed
    if not (term.start <= fe and bs <= term.stop and fe + 1 <= bs - 1):
        return [term]
    parts = [
        Term(term.label, term.category, term.start, fe, term.node, term.nbytes),
        Term(term.label, term.category, fe + 1, bs - 1, term.node, term.nbytes, (layer, cls)),
        Term(term.label, term.category, bs, term.stop, term.node, term.nbytes),
    ]
    return parts


def _recompute_costs(space: Space, cluster: Cluster, live: Liveness) -> dict:
    """(layer, mode) -> per recomputed op, its node and compute seconds per strategy."""
    cache: dict = {}
    out: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}
    for name, layer in live.layers.items():
        for mode, ops in layer.recompute_ops.items():
            entries = []
            for i in ops:
                op, node = space.graph.ops[i], space.op_node(i)
                fused = space.fusion.of(op)
                key = (op.kind, op.rule, id(space.strategies[node]), fused)
                key += (tuple(v.type for v in op.operands), op.attrs.get("causal"))
                if key not in cache:
                    cache[key] = np.array(
                        [op_cost(op, s, space.mesh, cluster, fused) for s in space.strategies[node]]
                    )
                entries.append((node, cache[key] * op.repeat if op.repeat != 1 else cache[key]))
            out[(name, mode)] = entries
    return out


def infeasible_error(memory: MemoryModel, problem: Problem, limit: float) -> InfeasiblePlanError:
    """The clear error: the smallest peak any layout (and recomputation) reaches, and its parts."""
    found = memory.minimum(problem)
    if found is None:
        return InfeasiblePlanError(
            f"the training step does not fit {gib(limit)} per device (the solver proved it), and "
            "its smallest peak was not found in time. Use more devices, a larger memory_limit, "
            "or a smaller batch"
        )
    peak, choice, decisions = found
    profile = memory.profile(choice, decisions)
    error = InfeasiblePlanError(
        f"the training step does not fit: its smallest modelled peak is {gib(peak)} per device "
        f"(sharding everything it can, recomputing {len(decisions)} of {len(memory.live.layers)} "
        f"layers) but the limit is {gib(limit)}. Largest at that peak: {profile.describe()}. "
        "Use more devices, a larger memory_limit, or a smaller batch"
    )
    error.minimum_bytes = peak  # type: ignore[attr-defined]
    return error
