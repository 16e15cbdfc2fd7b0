"""Tests of the pass registry and PassManager: pipeline strings, options, verify and print-after."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Literal

import pytest
import shardplan.passes
from shardplan.ir import Graph, IRVerifyError, Mesh, Sharding, ShardplanError, TensorType
from shardplan.passes import (
    PassManager,
    PassSpec,
    get_pass,
    parse_pipeline,
    register_pass,
    run_pipeline,
)
from shardplan.passes.annotate import AnnotateOptions
from shardplan.passes.propagate import PropagateOptions


@dataclass(frozen=True, slots=True)
class _ToyOptions:
    count: int = 1
    scale: float = 1.0
    flag: bool = False
    mode: Literal["a", "b"] = "a"
    label: str = ""
    limit: int | None = None


_CALLS: list[_ToyOptions] = []


@register_pass("test-toy", options=_ToyOptions)
def _toy(graph: Graph, options: _ToyOptions) -> None:
    """Records its options; edits nothing (returns None: in place)."""
    _CALLS.append(options)


@register_pass("test-break")
def _break(graph: Graph, options: object) -> Graph:
    """Leaves a value with a sharding that does not fit, so the verifier fails after it."""
    graph.inputs[0].sharding = Sharding.of(None)  # rank 1 on a rank-2 value
    return graph


def _graph() -> Graph:
    g = Graph("mlp", mesh=Mesh({"dp": 2, "tp": 4}, cluster="cpu-test"))
    x = g.add_input("x", TensorType((16, 64)), sharding=Sharding.of("dp", None), pinned=True)
    w = g.add_input("w", TensorType((64, 32)), sharding=Sharding.of(None, "tp"), pinned=True)
    y = g.add_op("dot", [x, w], [TensorType((16, 32))], names=["y"]).result
    g.set_outputs([y])
    return g


def test_list_passes_registers_builtin_passes_on_import() -> None:
    assert {"annotate", "propagate"} <= set(shardplan.passes.list_passes())
    assert get_pass("propagate").options is PropagateOptions
    assert get_pass("annotate").options is AnnotateOptions
    assert get_pass("propagate").summary.startswith("Infer shardings")


def test_get_pass_unknown_name_lists_known_passes() -> None:
    with pytest.raises(ShardplanError, match=r"unknown pass 'propagte'; known passes: .*propagate"):
        get_pass("propagte")
    with pytest.raises(ShardplanError, match="unknown pass 'nope'"):
        PassManager("annotate,nope")


def test_register_pass_rejects_bad_names_and_options() -> None:
    with pytest.raises(ShardplanError, match="kebab-case"):
        register_pass("Bad_Name")
    with pytest.raises(ShardplanError, match="frozen dataclass"):
        register_pass("test-bad-options", options=dict)


def test_parse_pipeline_reads_typed_options() -> None:
    specs = parse_pipeline(
        'annotate, test-toy{count=3 scale=0.5 flag=true mode=b label="x, y" limit=none},'
        "propagate{max-iterations=10,direction=forward}"
    )
    assert [s.name for s in specs] == ["annotate", "test-toy", "propagate"]
    assert specs[1].options == _ToyOptions(3, 0.5, True, "b", "x, y", None)
    assert specs[2].options == PropagateOptions(max_iterations=10, direction="forward")
    assert parse_pipeline("test_toy{limit=7}")[0].options.limit == 7


@pytest.mark.parametrize(
    ("pipeline", "message"),
    [
        ("propagate{max_iterations=ten}", "not a valid"),
        ("propagate{direction=sideways}", "choose one of"),
        ("propagate{conservative=maybe}", "not a valid"),
        ("propagate{bogus=1}", "its options are: max_iterations, direction, conservative"),
        ("propagate{max_iterations}", "bad option"),
        ("propagate{max_iterations=0}", "max_iterations must be >= 1"),
        ("propagate{max_iterations=1", "unbalanced"),
        ("annotate{pins=x}", "cannot be written in a pipeline string"),
    ],
)
def test_parse_pipeline_rejects_bad_options(pipeline: str, message: str) -> None:
    with pytest.raises(ShardplanError, match=message):
        parse_pipeline(pipeline)


def test_pass_manager_runs_in_order_with_python_options() -> None:
    _CALLS.clear()
    pm = PassManager(["test-toy{count=2}", PassSpec("test-toy", _ToyOptions(count=5))])
    pm.run(_graph())
    assert [o.count for o in _CALLS] == [2, 5]
    assert pm.pipeline == "test-toy{count=2},test-toy{count=5}"
    with pytest.raises(ShardplanError, match="takes _ToyOptions"):
        PassManager([("test-toy", PropagateOptions())])


def test_pass_manager_print_after_selected_passes() -> None:
    out = io.StringIO()
    graph = PassManager(
        "test-toy,propagate{max_iterations=5}", print_after={"propagate"}, dump=out
    ).run(_graph())
    text = out.getvalue()
    assert text.startswith("// -----// IR after propagate{max_iterations=5} //----- //\n")
    assert "IR after test-toy" not in text
    assert 'partial={"tp"}' not in text  # contraction dim k is unsharded
    assert '%y = dot(%x, %w) rule<"ik,kj->ij"> : f32[16,32] [{"dp"}, {"tp"}]' in text
    assert graph.outputs[0].sharding == Sharding.of("dp", "tp")


def test_pass_manager_print_after_all_to_callable() -> None:
    chunks: list[str] = []
    PassManager("test-toy,propagate", print_after="all", dump=chunks.append).run(_graph())
    assert [c.splitlines()[0] for c in chunks] == [
        "// -----// IR after test-toy //----- //",
        "// -----// IR after propagate //----- //",
    ]


def test_pass_manager_verify_each_names_the_failing_pass() -> None:
    g = _graph()
    g.inputs[0].sharding = Sharding.of("dp")  # rank 1 on a rank-2 value: invalid
    with pytest.raises(IRVerifyError, match="before the pipeline"):
        PassManager("test-toy", verify_each=True).run(g)
    with pytest.raises(IRVerifyError, match="after pass 'test-break'"):
        run_pipeline(_graph(), "test-toy,test-break", verify_each=True)
    run_pipeline(_graph(), "annotate,propagate", verify_each=True)
