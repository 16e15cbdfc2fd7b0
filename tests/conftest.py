"""Shared pytest options and fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)  # test helpers (plan_digests.py)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/ files from the current output instead of comparing",
    )


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    """True when the run was started with --update-golden."""
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(scope="session")
def tiny_llama_plan():
    """A 2-layer Llama-shaped training step (``shardplan.ir.models``) planned on dp=2 x tp=4 H100s:
    alike layers, ZeRO-style update, hundreds of reshards. Shared by the report tests (HTML,
    explain) because planning it takes 5-20 s on the loaded 2-core box."""
    import shardplan as sp
    from shardplan.ir.models import TransformerConfig, training_step

    config = TransformerConfig("tiny", 2, 256, 4, 1024, 512, 128)
    return sp.plan(
        training_step(config, batch=8), mesh=sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    )


@pytest.fixture(scope="session")
def shrunk_step():
    """``build(config, mesh, limit)`` -> ``(space, cluster, problem)``: a ``shardplan.ir.models``
    training step (batch 8) on ``mesh``, priced under ``limit`` and shrunk as the planner does
    (layers shared, followers merged): the set-up of the memory-bound solver tests."""
    from shardplan.costmodel import get_cluster
    from shardplan.ir.models import training_step
    from shardplan.solver.costs import build_problem, build_space
    from shardplan.solver.planner import shrink

    def build(config, mesh, limit):  # type: ignore[no-untyped-def]
        graph = training_step(config, batch=8)
        graph.mesh = mesh
        cluster = get_cluster(mesh.cluster)
        space = build_space(graph, mesh)
        problem = build_problem(space, cluster, limit)
        shrink(problem, space, True, True)
        return space, cluster, problem

    return build
