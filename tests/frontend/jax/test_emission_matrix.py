"""The JAX emitter over models x mesh shapes x plan kinds (issue 14, point 2).

Every cell plans a training step on 8 simulated CPU devices, jits it with ``plan.jit`` and checks
two things against the plan:
- numerics: the loss and every updated array (parameters, optimizer state) equal the unsharded
  ``jax.jit`` step (rtol 1e-4);
- collectives: XLA's compiled collectives (kind, bytes per device, mesh axes) are exactly the
  ones the plan predicts (``frontend/jax/hlo.py``).

Models: the examples' MLP, the examples' GPT (2 layers under ``lax.scan``; 1 layer unrolled) and
a GQA decoder (``gqa_decoder.py``). Meshes: (2, 4), (4, 2) and (2, 2, 2). Plan kinds: the free
plan, FSDP-pinned and Megatron-pinned (``sp.strategies``' pins for every input; the solver fills
in the rest; Megatron only where its pins split the weights: not the scanned GPT's stacked
ones). No cell is skipped: one that fails names what differed.
"""

from __future__ import annotations

import time

import gqa_decoder
import jax
import jax_gpt
import jax_mlp
import numpy as np
import pytest
import shardplan as sp
from plan_digests import check_plan
from shardplan.frontend.jax.capture import capture
from shardplan.frontend.jax.emit import make_jax_mesh
from shardplan.frontend.jax.hlo import check_plan_collectives

pytestmark = [pytest.mark.jax, pytest.mark.slow]

MESHES = {
    "2x4": {"dp": 2, "tp": 4},
    "4x2": {"dp": 4, "tp": 2},
    "2x2x2": {"dp": 2, "fsdp": 2, "tp": 2},
}
KINDS = ("free", "fsdp", "megatron")
PLAN_TIME_LIMIT = {2: 60, 3: 30}
"""Solver seconds by mesh rank: every cell, (2, 2, 2) included, plans within these limits on a
busy 2-core box (a cell that did not would fail here, loudly, within the CI budget)."""


def _model(name: str):
    match name:
        case "mlp":
            return jax_mlp.make()
        case "gpt-scan2":
            # Adam's eps >> |g|: with 1e-8 the first step is sign(g) where |g| ~ 1e-8, which
            # no other reduction order reproduces to 1e-4 (test_end_to_end.py, GPT).
            return jax_gpt.make(jax_gpt.GPTConfig(n_layers=2, scan_layers=True, adam_eps=1e-4))
        case "gpt1":
            return jax_gpt.make(jax_gpt.GPTConfig(n_layers=1, adam_eps=1e-4))
        case "gqa":
            return gqa_decoder.make()
    raise ValueError(name)


MODELS = ("mlp", "gqa", "gpt-scan2", "gpt1")


def _strategy(kind: str):
    return {"fsdp": sp.strategies.fsdp(), "megatron": sp.strategies.megatron(tp="tp")}[kind]


_CELLS: dict[tuple[str, str, str], object] = {}


def _cell(model: str, mesh_name: str, kind: str):
    """Plan and jit a cell once per session; a cell that cannot plan raises the same error in
    every test that uses it without solving again (functools.cache would retry)."""
    key = (model, mesh_name, kind)
    if key not in _CELLS:
        try:
            _CELLS[key] = _plan_cell(model, mesh_name, kind)
        except Exception as exc:  # re-raised below, in each test of the cell
            _CELLS[key] = exc
    if isinstance(_CELLS[key], Exception):
        raise _CELLS[key]
    return _CELLS[key]


def _plan_cell(model: str, mesh_name: str, kind: str):
    step, args = _model(model)
    mesh = sp.Mesh(MESHES[mesh_name], cluster="cpu-test")
    pins = None
    if kind != "free":
        graph, _ = capture(step, *args)
        by_name = {v.name: v for v in graph.inputs}
        pins = {
            by_name[name].origin.path: layout
            for name, layout in _strategy(kind).pins(graph, mesh).items()
        }
    start = time.perf_counter()
    limit = PLAN_TIME_LIMIT[len(MESHES[mesh_name])]
    plan = sp.plan(step, *args, mesh=mesh, pins=pins, time_limit=limit)
    seconds = time.perf_counter() - start
    check_plan(__file__, f"{model}-{mesh_name}-{kind}", plan)
    return step, args, plan, plan.jit(step, make_jax_mesh(plan)), seconds


def _kinds(model: str) -> tuple[str, ...]:
    """``sp.strategies.megatron`` splits 2-D projections by name; the scanned GPT's weights are
    stacked ``[layers, in, out]``, which its pins leave whole, so that cell would not be
    Megatron at all."""
    return ("free", "fsdp") if model == "gpt-scan2" else KINDS


CELLS = [(m, mesh, k) for m in MODELS for mesh in MESHES for k in _kinds(m)]


@pytest.mark.parametrize(("model", "mesh", "kind"), CELLS)
def test_plan_jit_matches_the_unsharded_step(model, mesh, kind):
    step, args, _, jitted, _ = _cell(model, mesh, kind)
    got, want = jitted(*args), jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


NOT_STRICT: set[tuple[str, str, str]] = set()
"""Known gaps that show only in some plans; none since CP-SAT stops at a deterministic budget
(the scanned GPT's free plan on (2,2,2) was one: its 30 s wall-clock solve under load)."""
KNOWN_COLLECTIVE_GAPS: dict[tuple[str, str, str], str] = {}
"""Cells whose compiled collectives differ from the plan's, as measured: strict (but for
``NOT_STRICT``), so a cell that starts matching fails here until it is taken off this list.
Empty: the last five (all on (2,2,2)) left it when the emitter pinned a staged reduction's
partial middle layout, kept one leading dim per pending axis, bound reduce-once dots
explicitly, and the checker stopped reading differently-sliced all-reduces as reduce-scatters
(``frontend/jax/pending.py``, docs/costmodel.md)."""


def _collective_cells() -> list:
    return [
        pytest.param(
            *cell,
            marks=pytest.mark.xfail(
                strict=cell not in NOT_STRICT, reason=KNOWN_COLLECTIVE_GAPS[cell]
            ),
        )
        if cell in KNOWN_COLLECTIVE_GAPS
        else cell
        for cell in CELLS
    ]


@pytest.mark.parametrize(("model", "mesh", "kind"), _collective_cells())
def test_xla_collectives_are_the_planned_ones(model, mesh, kind):
    _, args, plan, jitted, _ = _cell(model, mesh, kind)
    found = check_plan_collectives(plan, jitted, *args)
    assert found or not plan.collectives()


@pytest.mark.parametrize(("model", "mesh"), [(m, mesh) for m in MODELS for mesh in MESHES])
def test_pinned_plans_keep_their_pins(model, mesh):
    """The pinned cells are the strategies they claim: FSDP splits parameters over the data
    axes, Megatron splits the projections over tp (at least one each)."""
    for kind in _kinds(model)[1:]:
        _, _, plan, _, _ = _cell(model, mesh, kind)
        layouts = plan.parameter_shardings()
        params = {p: s for p, s in layouts.items() if p.startswith("params")}
        if kind == "fsdp":
            assert any(s.used_axes - {"tp"} for s in params.values()), params
        else:
            assert any("tp" in s.used_axes for s in params.values()), params
