"""Layer stamping: tracing 3 layers and stamping the rest gives exactly the fully traced graph."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.frontend.torch import stack
from shardplan.frontend.torch.capture import capture
from shardplan.ir import FrontendError, Graph, Origin

pytestmark = pytest.mark.torch


def canonical(graph: Graph) -> list[tuple]:
    """The graph with value names replaced by definition order (names may differ, nothing else)."""
    index = {}
    rows: list[tuple] = []
    for v in graph.inputs:
        index[v] = len(index)
        origin = v.origin
        if origin.path.startswith("_tensor_constant"):  # make_fx numbers lifted constants
            origin = Origin("_tensor_constant", origin.module, origin.source)
        rows.append(("input", v.type, v.role, origin))
    for op in graph.ops:
        operands = tuple(index[v] for v in op.operands)
        for r in op.results:
            index[r] = len(index)
        types = tuple(r.type for r in op.results)
        rows.append((op.kind, op.rule, tuple(sorted(op.attrs.items())), operands, types, op.origin))
    rows.append(("outputs", tuple(index[v] for v in graph.outputs), graph.output_aliases))
    return rows


def _context_rows(context) -> list:  # type: ignore[no-untyped-def]
    """The FQN-keyed tables of a capture context, with value names as input/op positions."""
    return [
        sorted(context.param_values), sorted(context.grad_values),
        sorted((k, sorted(v)) for k, v in context.state_values.items()),
        sorted(context.module_inputs), sorted(context.module_outputs),
    ]  # fmt: skip


@pytest.mark.parametrize(("name", "stamps"), [("hf_llama", True), ("hf_gpt2", False)])
def test_stamped_capture_equals_full_trace(examples, name, stamps) -> None:  # type: ignore[no-untyped-def]
    """Llama stamps; GPT-2's bias gradients run one layer late in backward (interleaved layers),
    which stamping refuses, so it is traced whole - the same graph either way."""
    model, inputs = examples[name].make(batch=4, layers=7, device="meta")
    assert stack.find_stack(model) is not None
    stamped, stamped_context = capture(model, *inputs)
    full, full_context = capture(model, *inputs, stamp_layers=False)
    assert stamped_context.stamped is stamps
    assert not full_context.stamped
    assert len(stamped.ops) == len(full.ops)
    assert canonical(stamped) == canonical(full)
    assert _context_rows(stamped_context) == _context_rows(full_context)
    # every value name the context holds exists in the graph, with the same role and origin path
    for fqn, value in stamped_context.param_values.items():
        assert stamped.value(value).origin.path == fqn
    for fqn, value in stamped_context.grad_values.items():
        assert full.value(full_context.grad_values[fqn]).type == stamped.value(value).type


def test_stamped_plan_equals_full_plan(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["hf_llama"].make(batch=8, layers=6, device="meta")
    mesh = sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test")
    stamped = sp.plan(model, *inputs, mesh=mesh)
    full = sp.plan(model, *inputs, mesh=mesh, stamp_layers=False)
    assert stamped.step_time == pytest.approx(full.step_time, rel=1e-9)
    assert stamped.peak_memory_bytes == full.peak_memory_bytes
    assert stamped.to_placements() == full.to_placements()


def test_unlike_layers_are_traced_whole(examples) -> None:  # type: ignore[no-untyped-def]
    model, _ = examples["hf_llama"].make(layers=6, device="meta")
    model.model.layers[4].self_attn.scaling = 0.5  # one layer differs: no stamping
    assert stack.find_stack(model) is None
    short, _ = examples["hf_llama"].make(layers=stack.MIN_LAYERS - 1, device="meta")
    assert stack.find_stack(short) is None


def test_follow_plan_refuses_a_stamped_capture(examples) -> None:  # type: ignore[no-untyped-def]
    from shardplan.frontend.torch.follow import PlanFollower

    model, inputs = examples["hf_llama"].make(layers=6, device="meta")
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"x": 2}, cluster="cpu-test"))
    with pytest.raises(FrontendError, match="stamp_layers=False"):
        PlanFollower(plan, None)  # refused before any device mesh is touched
