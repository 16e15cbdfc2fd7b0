"""A tiny HF Llama plans on meshes of three and four axes (the axis search), optimally on the
neighbourhood it ends in, with valid layouts that use every axis, and the plan applied on 8 and
16 simulated ranks computes the plain model's loss and gradients."""

from __future__ import annotations

import pytest
import shardplan as sp

MESHES = {
    "2x2x2": {"dp": 2, "fsdp": 2, "tp": 2},
    "2x2x2x2": {"dp": 2, "fsdp": 2, "cp": 2, "tp": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
def test_tiny_llama_plans_on_nd_mesh(examples, name: str) -> None:
    model, inputs = examples["hf_llama"].make(layers=1)
    mesh = sp.Mesh(MESHES[name], cluster="cpu-test")
    plan = sp.plan(model, *inputs, mesh=mesh)
    assert plan.solver.status == "OPTIMAL"
    assert plan.solver.gap == 0.0
    graph = plan.graph
    used: set[str] = set()
    for value in graph.values():
        layout = plan.shardings[value.name]
        layout.check(value.type, mesh)  # every layout is even and names real axes
        used |= {a for dim in layout.dims for a in dim}
    assert used == set(mesh.axis_names)  # the plan is not data parallel on one axis only
    assert plan.peak_memory_bytes <= plan.memory_limit


APPLY = """
import sys, warnings
sys.path[:0] = ["examples"]
warnings.simplefilter("ignore")
import shardplan as sp
from checks import torch_check
from hf_llama import make
model, inputs = make(layers=1)
torch_check(sp.plan(model, *inputs, mesh=sp.Mesh(dict(%r), cluster="cpu-test")), model, inputs)
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
def test_tiny_llama_nd_plan_applies_with_the_plain_models_numerics(name: str) -> None:
    """The plan applied on 8 and 16 simulated ranks: on every rank the loss and every gradient
    equal the plain model's (``examples/checks.py``). In a fresh interpreter: a simulated world
    of another size earlier in the same process leaves DTensor holding destroyed process
    groups ("Could not resolve the process group")."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    code = APPLY % (list(MESHES[name].items()),)
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "check passed: forward and backward" in done.stdout


@pytest.mark.slow
def test_finish_reuses_the_exact_steps_solve_without_changing_the_plan(
    examples, monkeypatch
) -> None:
    """The finish takes the best exact step's optimal plain solve instead of solving it again
    (solver/space_passes.py ``_reusable_step``): the plan is the one a re-solve gives."""
    from shardplan.solver import space_passes

    model, inputs = examples["hf_llama"].make(layers=1)
    mesh = sp.Mesh(MESHES["2x2x2"], cluster="cpu-test")
    reuse, reused = space_passes._reusable_step, []

    def spy(space, *args):  # type: ignore[no-untyped-def]
        found = reuse(space, *args)
        reused.append(found is not None)
        return found

    def never(space, *args):  # type: ignore[no-untyped-def]
        space.solved = None
        return None

    monkeypatch.setattr(space_passes, "_reusable_step", spy)
    plan = sp.plan(model, *inputs, mesh=mesh)
    assert reused[-1]  # the finish (the last solve) reused a step
    monkeypatch.setattr(space_passes, "_reusable_step", never)
    again = sp.plan(model, *inputs, mesh=mesh)
    assert plan.step_time == again.step_time
    assert plan.solver.objective == again.solver.objective
    assert plan.shardings == again.shardings
