"""Bad arguments at the public entry points fail at the door with one line naming the fix.

One test per class of bad input from issue 16: sizes, time limits, counts, names (case-
sensitive, with a did-you-mean), unknown keywords (graph, torch and JAX inputs), a class for an
instance, a dict for a mesh, the default cluster, unreadable plan files and output paths.
"""

from __future__ import annotations

import math
import warnings

import pytest
import shardplan as sp
from shardplan import ArgumentError
from shardplan.ir import checks
from shardplan.ir.errors import ShardingError
from shardplan.ir.graph import Graph, Origin, Role
from shardplan.ir.types import TensorType
from shardplan.solver import plan_files

MESH = sp.Mesh({"dp": 2}, cluster="h100-sxm")


def tiny_graph() -> Graph:
    """y = x @ w, small enough to plan in well under a second."""
    g = Graph(name="tiny")
    x = g.add_input("x", TensorType((64, 32), "f32"), Role.INPUT, Origin(path="x"))
    w = g.add_input("w", TensorType((32, 16), "f32"), Role.PARAMETER, Origin(path="w"))
    y = g.add_op("dot", [x, w], [TensorType((64, 16), "f32")], names=["y"]).result
    g.set_outputs([y])
    return g


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# -- sizes ------------------------------------------------------------------------------------
def test_memory_limit_accepts_the_cli_size_forms() -> None:
    """``"40GB"`` plans as 40e9 bytes would; the CLI and Python share one parser."""
    for given, expected in (("40GB", 40e9), ("512MiB", 512 * 2**20), (24e9, 24e9)):
        plan = sp.plan(tiny_graph(), mesh=MESH, memory_limit=given, time_limit=5)
        assert plan.memory_limit == expected
    from shardplan.cli import parse_size

    assert parse_size("512MiB") == checks.parse_size("512MiB") == 512 * 2**20


@pytest.mark.parametrize("bad", [-5, 0, math.nan, math.inf, "forty", "40 furlongs", True, [1]])
def test_bad_memory_limit_is_one_line(bad) -> None:
    with pytest.raises(ArgumentError) as exc:
        sp.plan(tiny_graph(), mesh=MESH, memory_limit=bad)
    assert "memory_limit" in one_line(exc)


@pytest.mark.parametrize("bad", [None, -1, 0, math.nan, math.inf, "30"])
def test_bad_time_limit_is_one_line(bad) -> None:
    with pytest.raises(ArgumentError) as exc:
        sp.plan(tiny_graph(), mesh=MESH, time_limit=bad)
    assert "time_limit" in one_line(exc)
    assert "seconds" in str(exc.value)


# -- meshes -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("axes", "words"),
    [
        ({"dp": "two"}, "size 'two' (str)"),
        ({"dp": 2.5}, "size 2.5 (float)"),
        ({"dp": 2.0}, "size 2.0 (float)"),
        ({"dp": 0}, "size 0"),
        ({"dp": -1}, "size -1"),
        ({"dp": True}, "size True"),
        ({"d p": 2}, "identifier"),
        ({1: 2}, "identifier"),
        ("dp=2", "dict of name -> size"),
        ([("dp", 2, 3)], "(name, size) pairs"),
        ([("dp", 2), ("dp", 4)], "unique"),
    ],
)
def test_bad_mesh_axes_never_become_something_else(axes, words) -> None:
    """``{"dp": 2.5}`` used to become dp=2 and ``{"dp": "two"}`` a ValueError from int()."""
    with pytest.raises(ShardingError) as exc:
        sp.Mesh(axes, cluster="h100-sxm")
    assert words in one_line(exc)


@pytest.mark.parametrize("bad", ["", 80, ["h100-sxm"]])
def test_mesh_cluster_must_be_a_name(bad) -> None:
    with pytest.raises(ShardingError, match="catalogue name"):
        sp.Mesh({"dp": 2}, cluster=bad)


def test_numpy_style_integers_are_whole_sizes() -> None:
    class Index:  # what numpy.int64 offers: __index__
        def __index__(self) -> int:
            return 4

    assert sp.Mesh({"tp": Index()}, cluster="cpu-test").shape == {"tp": 4}


def test_a_dict_mesh_plans_on_the_cluster_argument() -> None:
    """Decision: ``mesh={"dp": 2}`` is accepted as ``sp.Mesh({"dp": 2}, cluster=cluster)``."""
    plan = sp.plan(tiny_graph(), mesh={"dp": 2}, time_limit=5)
    assert plan.mesh == sp.Mesh({"dp": 2}, cluster="h100-sxm")
    plan = sp.plan(tiny_graph(), mesh={"dp": 2}, cluster="a100-80gb", time_limit=5)
    assert plan.mesh.cluster == "a100-80gb"
    with pytest.raises(ArgumentError, match=r"mesh= must be sp\.Mesh"):
        sp.plan(tiny_graph(), mesh="dp=2")


def test_every_way_of_writing_a_mesh_plans_on_one_default_cluster() -> None:
    """Decision (issue 37): a dict ``mesh=``, an ``sp.Mesh`` without ``cluster=`` and
    ``devices=N`` all plan on ``h100-sxm`` (or on the call's ``cluster=``), silently, with the
    summary naming the cluster; the same graph models the same step time either way."""
    assert sp.Mesh({"dp": 2}).cluster == checks.DEFAULT_CLUSTER == "h100-sxm"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        by_dict = sp.plan(tiny_graph(), mesh={"dp": 2, "tp": 2}, time_limit=5)
        by_mesh = sp.plan(tiny_graph(), mesh=sp.Mesh({"dp": 2, "tp": 2}), time_limit=5)
    assert by_dict.mesh == by_mesh.mesh == sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")
    assert by_dict.step_time == by_mesh.step_time
    assert "cluster h100-sxm" in str(by_mesh)
    on_a100 = sp.plan(tiny_graph(), mesh=sp.Mesh({"dp": 2}), cluster="a100-80gb", time_limit=5)
    assert on_a100.mesh.cluster == "a100-80gb"
    assert "cluster a100-80gb" in str(on_a100)
    given = sp.plan(tiny_graph(), mesh=sp.Mesh({"dp": 2}, cluster="cpu-test"), time_limit=5)
    assert given.mesh.cluster == "cpu-test"  # a cluster the mesh names is kept
    assert given.step_time != by_mesh.step_time


def test_unknown_cluster_suggests_the_near_miss() -> None:
    with pytest.raises(sp.ShardplanError) as exc:
        sp.plan(tiny_graph(), devices=2, cluster="H100-SXM")
    assert "did you mean 'h100-sxm'?" in one_line(exc)
    with pytest.raises(sp.ShardplanError, match="unknown mesh cluster 'h100'"):
        sp.plan(tiny_graph(), mesh=sp.Mesh({"dp": 2}, cluster="h100"))


# -- names and counts -------------------------------------------------------------------------
@pytest.mark.parametrize(("bad", "hint"), [("GPIPE", "did you mean 'gpipe'?"), ("bogus", "")])
def test_unknown_schedule_is_refused_not_modelled_as_1f1b(bad, hint) -> None:
    with pytest.raises(ArgumentError) as exc:
        sp.plan(tiny_graph(), mesh=MESH, schedule=bad)
    assert f"schedule={bad!r} is not one of '1f1b', 'gpipe', 'interleaved', 'auto'" in one_line(exc)
    assert hint in str(exc.value)


@pytest.mark.parametrize("bad", [0, -2, 2.5, "4"])
def test_bad_microbatches_is_refused_not_automatic(bad) -> None:
    with pytest.raises(ArgumentError) as exc:
        sp.plan(tiny_graph(), mesh=MESH, microbatches=bad)
    assert "microbatches" in one_line(exc)


def test_bad_devices_and_missing_mesh() -> None:
    with pytest.raises(ArgumentError, match="devices=0 must be >= 1"):
        sp.plan(tiny_graph(), devices=0)
    with pytest.raises(ArgumentError, match=r"needs mesh=sp\.Mesh"):
        sp.plan(tiny_graph())


@pytest.mark.parametrize("make", [sp.strategies.dp, sp.strategies.fsdp])
def test_strategies_refuse_an_unknown_recompute(make) -> None:
    with pytest.raises(ValueError, match="recompute='bogus' is not one of") as exc:
        make(recompute="bogus")
    assert isinstance(exc.value, sp.ShardplanError)
    with pytest.raises(sp.ShardplanError, match="did you mean 'full'"):
        make(recompute="Full")
    with pytest.raises(sp.ShardplanError, match="recompute='bogus'"):
        sp.strategies.zero(1, recompute="bogus")


# -- keywords and models ----------------------------------------------------------------------
def test_misspelt_keyword_is_refused_for_graphs() -> None:
    """A graph takes no frontend options; ``memry_limit`` used to be silently ignored."""
    with pytest.raises(ArgumentError) as exc:
        sp.plan(tiny_graph(), mesh=MESH, memry_limit=1e9)
    assert "'memry_limit'; did you mean 'memory_limit'?" in one_line(exc)
    with pytest.raises(ArgumentError, match="'mode'"):
        sp.plan(tiny_graph(), mesh=MESH, mode="inference")


def test_evaluate_and_whatif_check_their_arguments() -> None:
    graph = tiny_graph()
    with pytest.raises(ArgumentError, match="did you mean 'memory_limit'"):
        sp.evaluate(graph, mesh=MESH, strategy=sp.strategies.dp(), memory_limt=1)
    with pytest.raises(ArgumentError, match=r"strategy= must be one of sp\.strategies"):
        sp.evaluate(graph, mesh=MESH, strategy="dp")
    ev = sp.evaluate(graph, mesh={"dp": 2}, strategy=sp.strategies.dp(), memory_limit="1GB")
    assert ev.fits
    from shardplan.api.whatif import whatif

    with pytest.raises(ArgumentError, match="did you mean 'link_bandwidth'"):
        whatif(graph, mesh=MESH, vary={"link_bandwith": [1, 2]})
    with pytest.raises(ArgumentError, match="factor"):
        whatif(graph, mesh=MESH, vary={"flops": [0]})
    with pytest.raises(ArgumentError, match="repeat=0"):
        whatif(graph, mesh=MESH, vary={"flops": [1]}, repeat=0)


def test_load_plan_reports_unreadable_files_in_one_line(tmp_path) -> None:
    binary = tmp_path / "plan.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ArgumentError) as exc:
        sp.load_plan(binary)
    assert "not a plan file" in one_line(exc)
    with pytest.raises(ArgumentError, match="cannot read"):
        sp.load_plan(tmp_path / "missing.json")
    with pytest.raises(ArgumentError, match="str or Path"):
        sp.load_plan(42)


# -- output files -----------------------------------------------------------------------------
def test_output_path_checked_before_work(tmp_path) -> None:
    with pytest.raises(ArgumentError, match="no directory"):
        plan_files.check_output_path(tmp_path / "missing" / "plan.json")
    with pytest.raises(ArgumentError, match="is a directory"):
        plan_files.check_output_path(tmp_path)
    assert plan_files.check_output_path(tmp_path / "plan.json") == tmp_path / "plan.json"


def test_a_failed_atomic_write_keeps_the_previous_file(tmp_path) -> None:
    target = tmp_path / "plan.json"
    target.write_text("the previous good plan")
    with pytest.raises(UnicodeEncodeError):
        plan_files.atomic_write_text(target, "ok so far \udc80 then a failure mid-write")
    assert target.read_text() == "the previous good plan"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temp file left
    plan_files.atomic_write_text(target, "new")
    assert target.read_text() == "new"


# -- torch and JAX inputs ---------------------------------------------------------------------
@pytest.mark.torch
def test_torch_class_instead_of_instance_and_misspelt_keyword() -> None:
    torch = pytest.importorskip("torch")
    x = torch.randn(8, 4)
    with pytest.raises(ArgumentError) as exc:
        sp.plan(torch.nn.Linear, x, mesh=MESH)
    assert "got the class Linear, not a model; pass an instance" in one_line(exc)
    with pytest.raises(ArgumentError) as exc:
        sp.plan(torch.nn.Linear(4, 4), x, mesh=MESH, memry_limit=1e9)
    text = one_line(exc)
    assert "did you mean 'memory_limit'?" in text
    assert "the torch frontend takes" in text
    with pytest.raises(ArgumentError, match="did you mean 'optimizer'"):
        sp.plan(torch.nn.Linear(4, 4), x, mesh=MESH, optimiser="sgd")


@pytest.mark.jax
def test_jax_misspelt_keyword() -> None:
    jax = pytest.importorskip("jax")
    x = jax.ShapeDtypeStruct((8, 4), "float32")
    with pytest.raises(ArgumentError) as exc:
        sp.plan(lambda a: a * 2, x, mesh=MESH, memry_limit=1e9)
    assert "did you mean 'memory_limit'?" in one_line(exc)
    assert "the JAX frontend takes" in str(exc.value)


def test_plan_save_is_atomic_and_loads_back(tmp_path, monkeypatch) -> None:
    plan = sp.plan(tiny_graph(), mesh=MESH, time_limit=5)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert sp.load_plan(path).shardings == plan.shardings

    def full_disk(src, dst) -> None:
        raise OSError(28, "full")

    monkeypatch.setattr(plan_files.os, "replace", full_disk)
    with pytest.raises(OSError, match="full"):
        plan.save(path)
    assert sp.load_plan(path).shardings == plan.shardings
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_evaluate_takes_an_unbounded_memory_limit() -> None:
    """``sp.evaluate`` prices a strategy whether it fits or not: ``memory_limit=math.inf`` is
    "no limit" there (``sp.plan`` refuses it, above); NaN and negatives stay refused."""
    strategy = sp.strategies.dp()
    ev = sp.evaluate(tiny_graph(), mesh=MESH, strategy=strategy, memory_limit=math.inf)
    assert ev.fits
    for bad in (math.nan, -5):
        with pytest.raises(ArgumentError):
            sp.evaluate(tiny_graph(), mesh=MESH, strategy=strategy, memory_limit=bad)


def test_an_axis_the_plan_cannot_use_is_named_with_the_fix() -> None:
    """``dp=3`` with a batch of 8 (and widths 3 does not divide): the plan is valid but the
    axis splits nothing, so its devices repeat the others' work. ``sp.plan`` says so, naming
    the axis, its size and batch sizes that would use it; the summary line says it too. With
    a batch the axis divides, nothing is said."""
    import sys
    from pathlib import Path

    from shardplan.solver.summary import idle_axes, strategy_words

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from mlp_graph import make

    mesh = sp.Mesh({"dp": 3, "tp": 2}, cluster="h100-sxm")
    with pytest.warns(sp.IdleAxisWarning) as caught:
        plan = sp.plan(make(batch=8, model=64, hidden=128), mesh=mesh)
    text = str(caught[0].message)
    assert "'dp' (size 3)" in text, text
    assert "batch (8)" in text, text
    assert "6 or 9" in text, text
    assert caught[0].filename == __file__  # points at the user's call, not inside shardplan
    assert "'tp'" not in text  # 8 divides by 2: leaving tp idle was the solver's choice
    assert "dp" in idle_axes(plan)
    assert "dp idle" in strategy_words(plan)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        sp.plan(make(batch=12, model=64, hidden=128), mesh=mesh)
    idle = [w for w in later if issubclass(w.category, sp.IdleAxisWarning)]
    # the batch divides: no axis is named as unusable; the tiny step's idle devices are said
    # by the subclass, with the modelled reason (tests/test_idle_devices.py)
    assert all(issubclass(w.category, sp.IdleDevicesWarning) for w in idle), idle
    assert all("'dp' (size 3)" not in str(w.message) for w in idle)
