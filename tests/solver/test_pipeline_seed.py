"""Seeding a memory-bound solve from its LP (``plan_graph(lp_seed=True)``, what a pipeline's
sub-mesh solves use): the LP's layouts with every layer fully recomputed start the seeded path
(primal heuristic, Lagrangian bound, ``MEMORY_GAP`` stop); the plan fits, is no slower than
that seed, and its bound is honest against the same problem seeded by the hand-written
strategies (as ``sp.plan`` seeds a mesh without ``pp``)."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.api.evaluate import best_baseline
from shardplan.ir.models import TransformerConfig, training_step
from shardplan.solver import ilp, memory_solve
from shardplan.solver.planner import plan_graph

MESH = sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")
CONFIG = TransformerConfig("t", 8, 256, 4, 1024, 512, 64)  # MEMORY_BOUND_LAYERS layers
LIMIT = 164 * 2**20  # the LP optimum peaks at 167.6 MiB (tests/solver/test_memory_gap.py)


@pytest.fixture(scope="module")
def seeded_and_other():  # type: ignore[no-untyped-def]
    seeds: list[float] = []  # objective of each seed the LP gave
    real = ilp._lp_seed

    def spy(problem, hints, seeded, wanted, relaxation, memory, start):  # type: ignore[no-untyped-def]
        found = real(problem, hints, seeded, wanted, relaxation, memory, start)
        if found[1] and not seeded:  # seeded here: price that seed as the solver saw it
            seed = memory_solve._recompute_everything(problem, relaxation.choice, memory, start)
            seeds.append(seed.objective)
        return found

    ilp._lp_seed = spy
    try:
        seeded = plan_graph(
            training_step(CONFIG, batch=8), MESH, memory_limit=LIMIT, overlap=False, lp_seed=True
        )
    finally:
        ilp._lp_seed = real
    # the same problem seeded by the hand-written strategies instead (as sp.plan seeds it)
    graph = training_step(CONFIG, batch=8)
    other = plan_graph(
        graph, MESH, memory_limit=LIMIT, overlap=False,
        fallback=lambda: best_baseline(graph, MESH, None, LIMIT),
    )  # fmt: skip
    return seeded, other, seeds


def test_the_lp_seeds_the_binding_solve_and_the_plan_fits(seeded_and_other) -> None:  # type: ignore[no-untyped-def]
    seeded, _, seeds = seeded_and_other
    assert seeds  # the plain objective's solve started from the LP's layouts
    assert seeded.peak_memory_bytes <= LIMIT
    s = seeded.solver
    assert 0 <= s.bound <= s.objective <= max(seeds) * (1 + 1e-9)  # no slower than its seed


def test_the_seeded_bound_is_honest_against_another_seed(seeded_and_other) -> None:  # type: ignore[no-untyped-def]
    seeded, other, _ = seeded_and_other
    # both bound the same problem (the plain objective only): neither above the other's plan
    assert seeded.solver.bound <= other.solver.objective * (1 + 1e-9)
    assert other.solver.bound <= seeded.solver.objective * (1 + 1e-9)
    assert other.peak_memory_bytes <= LIMIT


@pytest.fixture(scope="module")
def without_search(seeded_and_other):  # type: ignore[no-untyped-def]
    """The LP-seeded solve with ``memory_search=False`` (a pipeline's sub-mesh solves), and
    how many times CP-SAT's capped search ran in it."""
    return _plan_counting_searches(lp_seed=True)


def _plan_counting_searches(**options):  # type: ignore[no-untyped-def]
    """The memory-bound step planned with ``memory_search=False`` and ``options``, and a list
    with one entry per run of CP-SAT's capped search (``ilp._search``) in it."""
    searches: list[int] = []
    real = ilp._search

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        searches.append(1)
        return real(*args, **kwargs)

    ilp._search = spy
    try:
        plan = plan_graph(
            training_step(CONFIG, batch=8), MESH, memory_limit=LIMIT, overlap=False,
            memory_search=False, **options,
        )  # fmt: skip
    finally:
        ilp._search = real
    return plan, searches


def test_without_the_search_the_seeded_point_stands_with_an_honest_bound(
    seeded_and_other, without_search
) -> None:  # type: ignore[no-untyped-def]
    seeded, other, seeds = seeded_and_other
    plan, searches = without_search
    s = plan.solver
    gap = memory_solve.MEMORY_GAP
    assert seeded.solver.objective > seeded.solver.bound * (1 + gap)  # not proven
    assert not searches  # so the search would have run: it did not
    assert plan.peak_memory_bytes <= LIMIT
    assert 0 <= s.bound <= s.objective <= max(seeds) * (1 + 1e-9)  # no slower than its seed
    # the same bound as with the search (it comes before it), below every plan of the problem
    assert s.bound == pytest.approx(seeded.solver.bound, rel=1e-9)
    assert s.bound <= min(seeded.solver.objective, other.solver.objective) * (1 + 1e-9)


def test_a_pipelines_sub_mesh_solves_skip_the_search_unless_recomputation_is_fixed() -> None:
    from shardplan.solver.pipeline import _seeded

    assert _seeded({}) == {"memory_search": False, "lp_seed": True}
    assert _seeded({"recompute": False}) == {"recompute": False}


def test_without_the_search_and_a_fitting_seed_the_fallback_is_returned_unsearched(
    seeded_and_other,
) -> None:  # type: ignore[no-untyped-def]
    """No seed (``lp_seed=False``, as an axis-search step or start in a pipeline) and
    ``memory_search=False``: the LP's layouts with every layer recomputed are returned without
    CP-SAT's search, which on the HF-captured 70B pipeline found no plan in any of its six
    solves (6-8 s each) before this same fallback."""
    _, other, seeds = seeded_and_other
    plan, searches = _plan_counting_searches()
    s = plan.solver
    assert not searches
    assert plan.peak_memory_bytes <= LIMIT
    assert s.objective == pytest.approx(min(seeds), rel=1e-9)  # the LP's, all recomputed
    assert 0 <= s.bound <= min(s.objective, other.solver.objective) * (1 + 1e-9)
