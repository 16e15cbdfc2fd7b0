"""A mesh holds its cluster (issue 39, point 5): ``Mesh(axes, cluster=Cluster(...))`` plans on
that object without registering it, the same plan as the registered name, and ``sp.whatif``
leaves the process-wide registry as it found it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import shardplan as sp
from shardplan.api.whatif import whatif
from shardplan.costmodel import (
    Cluster,
    UnknownClusterError,
    cluster_of,
    get_cluster,
    known_clusters,
)
from shardplan.costmodel import cluster as cluster_module
from shardplan.costmodel.simulate import simulate
from shardplan.ir import Mesh
from shardplan.ir.errors import ShardingError
from shardplan.ir.models import TransformerConfig, training_step
from shardplan.solver.serialize import plan_to_json

TINY = TransformerConfig("tiny", 1, 256, 4, 1024, 1024, 128)
NAME = "h100-sxm-slow"


def _slow() -> Cluster:
    """H100 SXM at 1/100 of its FLOP/s, under a name nobody registered: the tiny step becomes
    compute-bound, so splitting it pays, and a planner that read h100-sxm instead of this
    object would model a far shorter step."""
    base = get_cluster("h100-sxm")
    peaks = tuple((d, f / 100) for d, f in base.peak_flops)
    return replace(base, name=NAME, peak_flops=peaks)


def _registry() -> dict[str, object]:
    return {name: get_cluster(name) for name in known_clusters()}


def _plan(mesh: Mesh) -> sp.Plan:
    return sp.plan(training_step(TINY, batch=8), mesh=mesh, time_limit=10)


def _sharded(plan: sp.Plan) -> list[str]:
    return [name for name, s in plan.shardings.items() if any(s.dims) or s.partial]


def test_mesh_holds_a_cluster_object_and_compares_by_name():
    held = _slow()
    mesh = Mesh({"dp": 2, "tp": 4}, cluster=held)
    named = Mesh({"dp": 2, "tp": 4}, cluster=NAME)
    assert mesh.cluster == NAME
    assert mesh.hardware is held
    assert mesh.cluster_given
    assert mesh == named
    assert hash(mesh) == hash(named)
    assert repr(mesh) == repr(named)
    assert named.hardware is None
    assert cluster_of(mesh) is held
    assert cluster_of(Mesh({"dp": 2}, cluster="h100-sxm")) is get_cluster("h100-sxm")
    sub = mesh.with_axes([("tp", 4)])
    assert sub.hardware is held
    assert sub.axes == (("tp", 4),)
    with pytest.raises(UnknownClusterError, match=NAME):
        cluster_of(named)  # the name alone was never registered
    for bad in (3, "", object()):
        with pytest.raises(ShardingError, match="Cluster object"):
            Mesh({"dp": 2}, cluster=bad)


def test_unregistered_cluster_plans_like_its_registered_name(monkeypatch):
    held = _slow()
    before = _registry()
    by_object = _plan(Mesh({"dp": 2, "tp": 4}, cluster=held))
    assert NAME not in known_clusters()
    assert _registry() == before
    assert by_object.mesh.hardware is held
    assert _sharded(by_object)
    assert simulate(by_object).step_time == pytest.approx(by_object.step_time, rel=1e-9)
    # the same cluster by name, registered for this test only
    monkeypatch.setitem(cluster_module._REGISTRY, NAME, held)
    by_name = _plan(Mesh({"dp": 2, "tp": 4}, cluster=NAME))
    assert plan_to_json(by_object) == plan_to_json(by_name)
    # and the held object's numbers were what the planner priced, not h100-sxm's
    fast = _plan(Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm"))
    assert dict(by_object.shardings) != dict(fast.shardings)
    assert by_object.step_time > fast.step_time


def test_plan_and_evaluate_take_an_unregistered_cluster_argument():
    held = _slow()
    before = _registry()
    plan = sp.plan(training_step(TINY, batch=8), mesh={"dp": 2, "tp": 4}, cluster=held,
                   time_limit=10)  # fmt: skip
    assert plan.mesh.hardware is held
    assert _sharded(plan)
    dp = sp.strategies.dp()
    slow = sp.evaluate(
        training_step(TINY, batch=8), mesh=Mesh({"dp": 8}, cluster=held), strategy=dp
    )
    fast = sp.evaluate(training_step(TINY, batch=8), mesh=Mesh({"dp": 8}), strategy=dp)
    assert slow.plan.mesh.hardware is held
    assert _sharded(slow.plan)
    assert slow.step_time > fast.step_time
    assert _registry() == before


def test_whatif_registers_nothing():
    held = _slow()
    before = _registry()
    result = whatif(
        training_step(TINY, batch=8), mesh=Mesh({"dp": 2, "tp": 4}, cluster=held),
        vary={"flops": [1, 4], "link_bandwidth": [0.25, 4]}, time_limit=10,
    )  # fmt: skip
    assert _registry() == before
    assert all(row.status == "ok" for row in result.rows), result.table()
    assert result.cluster == NAME
    by_factor = {(r.parameter, r.factor): r for r in result.rows}
    assert by_factor[("flops", 4.0)].compute_time < by_factor[("flops", 1.0)].compute_time
    slow, fast = by_factor[("link_bandwidth", 0.25)], by_factor[("link_bandwidth", 4.0)]
    assert fast.step_time < slow.step_time


def test_pipeline_stages_and_mesh_search_keep_the_held_cluster():
    """Sub-meshes (a pipeline's stage mesh) and searched mesh shapes plan on the held object."""
    held = _slow()
    before = _registry()
    two = replace(TINY, layers=2)
    piped = sp.plan(training_step(two, batch=8), mesh=Mesh({"pp": 2, "dp": 2}, cluster=held),
                    time_limit=10)  # fmt: skip
    assert piped.pipeline is not None
    assert piped.stage_mesh.hardware is held
    searched = sp.plan(training_step(two, batch=8), devices=4, cluster=held, time_limit=10)
    assert searched.mesh.hardware is held
    assert len(searched.candidates) > 1
    assert _registry() == before
