"""A Plan is an immutable value: no field can be assigned, ``solver/plan.py`` imports no
frontend, and its emitters (``plan.apply``, ``plan.jit``...) dispatch through the registry."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import shardplan as sp
from shardplan import Mesh, Plan, Sharding, TensorType
from shardplan.ir import FrontendError, Graph, Origin, Role
from shardplan.solver import plan as plan_module
from shardplan.solver.plan import SolverStats, register_emitter

PLAN_PY = Path(plan_module.__file__)


def _plan() -> Plan:
    """``x @ w`` with the batch split over dp and ``w`` replicated, built by hand."""
    g = Graph(name="dot")
    x = g.add_input("x", TensorType((8, 16), "f32"), Role.INPUT, Origin(path="x"))
    w = g.add_input("w", TensorType((16, 4), "f32"), Role.PARAMETER, Origin(path="fc.weight"))
    out = g.add_op("dot", [x, w], [TensorType((8, 4), "f32")], names=["out"]).result
    g.set_outputs([out])
    batch, whole = Sharding.of("dp", None), Sharding.of(None, None)
    return Plan(
        graph=g,
        mesh=Mesh({"dp": 2}, cluster="cpu-test"),
        shardings={"x": batch, "w": whole, "out": batch},
        operand_shardings={(0, 0): batch, (0, 1): whole},
        reshards=[],
        compute_time=1e-5,
        comm_time=0.0,
        peak_memory_bytes=1024,
        memory={"parameters": 256},
        solver=SolverStats("OPTIMAL", 1e-5, 1e-5, 0.1, 1, 1),
        output_shardings=[batch],
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("mesh", Mesh({"dp": 4}, cluster="cpu-test")), ("compute_time", 0.0),
     ("frontend_context", object()), ("timings", {}), ("not_a_field", 1)],
)  # fmt: skip
def test_plan_fields_cannot_be_assigned(field: str, value: object) -> None:
    """Assigning a field (or a new attribute: the class has slots) raises."""
    plan = _plan()
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError, TypeError)):
        setattr(plan, field, value)
    assert not hasattr(plan, "__dict__")


def test_plan_replace_and_with_context_make_new_plans() -> None:
    """``dataclasses.replace`` and ``with_context`` return changed copies; the original stays."""
    plan, context = _plan(), object()
    carried = plan.with_context(context)  # type: ignore[arg-type]
    assert carried is not plan
    assert carried.frontend_context is context
    assert plan.frontend_context is None
    assert carried.to_json() == plan.to_json()  # the context is never serialised
    timed = dataclasses.replace(plan, timings={"solve": 1.0})
    assert timed.timings == {"solve": 1.0}
    assert plan.timings == {}


def _frontend_imports(source: str, module: str) -> list[str]:
    """Every import in ``source`` (inside functions too) that resolves into
    ``shardplan.frontend`` or a framework, ``module`` being the dotted name of its file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = module.split(".")[: len(module.split(".")) - node.level]
            base = ".".join([*package, node.module] if node.module else package)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [
            n for n in names if n.startswith("shardplan.frontend") or n.split(".")[0] in _FRAMEWORKS
        ]
    return found


_FRAMEWORKS = ("torch", "jax", "jaxlib")


def test_plan_module_imports_no_frontend() -> None:
    """``solver/plan.py`` has no import of ``frontend`` (nor torch / jax), in any function;
    the check does see such an import where one is (an in-function relative import)."""
    assert _frontend_imports(PLAN_PY.read_text(), "shardplan.solver.plan") == []
    planted = "def f():\n    from ..frontend.torch import emit\n    import jax.numpy\n"
    assert _frontend_imports(planted, "shardplan.solver.plan") == [
        "shardplan.frontend.torch", "shardplan.frontend.torch.emit", "jax.numpy",
    ]  # fmt: skip


def test_loaded_plan_dispatches_through_the_registry(tmp_path, monkeypatch) -> None:
    """``load_plan(path).apply`` / ``.jit`` call whatever is registered under that name,
    with the loaded plan and the arguments as given."""
    calls: list[tuple] = []
    monkeypatch.setitem(plan_module._EMITTERS, "apply", lambda *a: calls.append(("apply", *a)))
    monkeypatch.setitem(plan_module._EMITTERS, "jit", lambda *a: calls.append(("jit", *a)))
    path = tmp_path / "plan.json"
    _plan().save(path)
    loaded = sp.load_plan(path)
    loaded.apply("model", "device mesh")
    loaded.jit()
    assert calls == [("apply", loaded, "model", "device mesh"), ("jit", loaded, None, None)]


def test_the_frontends_register_every_plan_emitter() -> None:
    """``import shardplan`` registers the frontends' functions (and ``to_torchtitan``)."""
    from shardplan.frontend import jax as jax_frontend
    from shardplan.frontend import torch as torch_frontend

    emitters = plan_module._EMITTERS
    assert emitters["apply"] is torch_frontend.apply
    assert emitters["jit"] is jax_frontend.jit
    assert emitters["to_torchtitan"] is sp.to_torchtitan
    methods = {n for n in vars(Plan) if n in emitters}
    assert methods == set(emitters)  # every emitter a method, every emitter method registered


def test_a_missing_emitter_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.delitem(plan_module._EMITTERS, "apply")
    with pytest.raises(FrontendError, match=r"Plan\.apply has no emitter registered.*import"):
        _plan().apply(None, None)
    register_emitter("apply", sp.frontend.torch.apply)  # monkeypatch restores it anyway
    with pytest.raises(sp.ShardplanError, match="not an identifier"):
        register_emitter("to torch", print)


BLOCKED_SCRIPT = textwrap.dedent(
    """
    import sys

    class Block:  # every import of torch / jax fails, as if they were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "jax", "jaxlib"):
                raise ImportError(f"{name} is blocked for this test")

    sys.meta_path.insert(0, Block())
    import shardplan as sp

    plan = sp.load_plan(sys.argv[1])
    for emit in (lambda: plan.apply(None, None), lambda: plan.jit()):
        try:
            emit()
        except sp.ShardplanError as error:
            print(type(error).__name__, error)
    """
)


def test_emitting_without_the_framework_names_it(tmp_path) -> None:
    """With torch and jax not importable, ``plan.apply`` / ``plan.jit`` of a loaded plan raise
    a ``FrontendError`` that names the framework and how to install it."""
    path = tmp_path / "plan.json"
    _plan().save(path)
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_SCRIPT, str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    torch_line, jax_line = result.stdout.splitlines()
    assert torch_line.startswith("FrontendError apply needs torch")
    assert "pip install torch" in torch_line
    assert jax_line.startswith("FrontendError jit needs jax")
