"""The axis search for meshes of three or more axes: pins, their merged-mesh form, coordinates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import shardplan as sp
from shardplan.ir import Sharding
from shardplan.passes.enumerate_strategies import layout_coords
from shardplan.solver.axis_search import _to_merged
from shardplan.solver.strategies import ParallelStrategy

ROOT = Path(__file__).resolve().parents[2]
OUTER = ["dp", "fsdp"]


def _mlp_graph():
    spec = importlib.util.spec_from_file_location(
        "mlp_graph_example", ROOT / "examples" / "mlp_graph.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make(batch=8192, model=4096, hidden=16384)


def test_pins_split_by_all_outer_axes_take_the_merged_axis() -> None:
    pin = Sharding((("dp", "fsdp", "tp"), ()))
    assert _to_merged(pin, OUTER, "dp_fsdp") == Sharding((("dp_fsdp", "tp"), ()))
    assert _to_merged(Sharding(((), ("tp",))), OUTER, "dp_fsdp") == Sharding(((), ("tp",)))
    pending = Sharding(((), ()), frozenset({"dp", "fsdp"}))
    assert _to_merged(pending, OUTER, "dp_fsdp") == Sharding(((), ()), frozenset({"dp_fsdp"}))


def test_pins_split_by_some_outer_axes_have_no_merged_form() -> None:
    assert _to_merged(Sharding((("fsdp",), ())), OUTER, "dp_fsdp") is None
    assert _to_merged(Sharding(((), ()), frozenset({"dp"})), OUTER, "dp_fsdp") is None


def test_layout_coordinates_name_the_dim_of_each_axis() -> None:
    mesh = sp.Mesh({"dp": 2, "fsdp": 2, "tp": 2}, cluster="cpu-test")
    assert layout_coords(Sharding((("dp", "fsdp"), ("tp",))), mesh) == (0, 0, 1)
    assert layout_coords(Sharding(((), ("fsdp",))), mesh) == (None, 1, None)


def test_hsdp_pins_are_honoured_on_a_3d_mesh() -> None:
    """Parameters split by fsdp only (no merged form): left out of the start, kept exactly."""
    graph = _mlp_graph()
    mesh = sp.Mesh({"dp": 2, "fsdp": 2, "tp": 2}, cluster="h100-sxm")
    pins = ParallelStrategy("hsdp", dp=("fsdp",), shard_params=True).pins(graph, mesh)
    assert any(_to_merged(p, OUTER, "dp_fsdp") is None for p in pins.values())
    plan = sp.plan(graph, mesh=mesh, pins=pins)
    for name, pin in pins.items():
        assert plan.shardings[name] == pin
