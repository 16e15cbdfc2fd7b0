"""Tests of the annotate pass: pins by value name, origin path and glob; clear errors."""

from __future__ import annotations

import pytest
from shardplan.ir import Graph, Mesh, Origin, Role, Sharding, ShardingError, TensorType
from shardplan.passes import PassManager, PassSpec
from shardplan.passes.annotate import AnnotateOptions, annotate, annotate_pass

MESH = Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")
COLWISE = Sharding.of(None, "tp")


def _layers(n: int = 2) -> Graph:
    """x @ wq per layer, with parameters named by their FQN origin ``layers.<i>.wq.weight``."""
    g = Graph("layers", mesh=MESH)
    cur = g.add_input("x", TensorType((16, 64)), origin=Origin(path="batch['x']"))
    for i in range(n):
        path = f"layers.{i}.wq.weight"
        w = g.add_input(f"wq{i}", TensorType((64, 64)), Role.PARAMETER, Origin(path=path))
        cur = g.add_op(
            "dot", [cur, w], [TensorType((16, 64))], origin=Origin(module=f"layers.{i}")
        ).result
    g.set_outputs([cur])
    return g


def test_annotate_pins_by_value_name_and_percent_name() -> None:
    g = _layers()
    annotate(g, {"x": Sharding.of("dp", None), "%wq1": COLWISE})
    x, w1 = g.value("x"), g.value("wq1")
    assert (x.sharding, x.pinned) == (Sharding.of("dp", None), True)
    assert (w1.sharding, w1.pinned) == (COLWISE, True)
    assert g.value("wq0").sharding is None


def test_annotate_pins_by_origin_path_and_glob() -> None:
    g = _layers(3)
    annotate(g, {"layers.*.wq.weight": COLWISE, "batch['x']": Sharding.of("dp", None)})
    annotate(g, {"batch['?']": Sharding.of(None, "tp")})  # brackets stay literal in globs
    assert all(g.value(f"wq{i}").sharding == COLWISE for i in range(3))
    assert g.value("x").sharding == Sharding.of(None, "tp")


def test_annotate_exact_key_beats_glob() -> None:
    g = _layers(3)
    rowwise = Sharding.of("tp", None)
    annotate(g, {"layers.1.wq.weight": rowwise, "layers.*.wq.weight": COLWISE})
    assert [g.value(f"wq{i}").sharding for i in range(3)] == [COLWISE, rowwise, COLWISE]


def test_annotate_pin_that_does_not_fit_names_value_origin_and_fix() -> None:
    g = _layers()
    bad = Sharding.of(None, ("dp", "tp"), None)
    with pytest.raises(
        ShardingError, match=r"(?s)%wq0 \(layers\.0\.wq\.weight\).*f32\[64,64\].*hint"
    ):
        annotate(g, {"layers.0.wq.weight": bad})
    g2 = Graph("odd", mesh=MESH)
    g2.add_input("v", TensorType((6, 8)))
    with pytest.raises(ShardingError, match=r"(?s)not divisible.*hint: give one axis set"):
        annotate(g2, {"v": Sharding.of("tp", None)})


def test_annotate_unknown_key_suggests_close_names() -> None:
    g = _layers()
    with pytest.raises(
        ShardingError, match=r"'layers\.0\.wk\.weight' matches no value.*'layers\.0\.wq\.weight'"
    ):
        annotate(g, {"layers.0.wk.weight": COLWISE})
    with pytest.raises(ShardingError, match="matches no value"):
        annotate(g, {"decoder.*": COLWISE})


def test_annotate_needs_a_mesh() -> None:
    g = Graph("nomesh")
    g.add_input("x", TensorType((4,)))
    with pytest.raises(ShardingError, match="no mesh"):
        annotate(g, {"x": Sharding.of(None)})


def test_annotate_runs_from_the_pass_manager_then_propagates() -> None:
    g = _layers(2)
    pins = (("x", Sharding.of("dp", None)), ("layers.*.wq.weight", COLWISE))
    pm = PassManager([PassSpec("annotate", AnnotateOptions(pins)), "propagate"], verify_each=True)
    out = pm.run(g)
    assert out.outputs[0].sharding == Sharding.of("dp", "tp")
    assert annotate_pass(out, AnnotateOptions()) is out  # no pins: nothing to do
