"""Table-wise embedding tables of a plain-PyTorch DLRM: each table whole on one device.

The tiny DLRM of ``test_recsys.py`` (4 ``nn.EmbeddingBag`` tables, jagged ids) is planned with
its tables pinned table-wise (``sp.strategies.embedding(table_wise=...)``) on (8,) and (2, 4),
alone and mixed with row-wise and column-wise tables. Each cell checks:

- the owners: one table per device (4 tables on 8 devices: balanced by bytes), recorded on
  the plan and saved with it;
- one applied step on simulated ranks, then one under ``follow_plan``: the loss and every
  gradient equal the plain model's (rtol 1e-4), a table-wise table's gradient read on its
  owner and zero on every other device (no all-reduce made it whole there);
- under ``follow_plan`` the collectives issued (kind, axes, bytes) are the plan's own: a
  scatter and a gather (all-to-all) per table-wise lookup, no gradient all-reduce for them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json

import pytest
import shardplan as sp
import torch
from plan_digests import check_plan
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.follow import follow_plan
from shardplan.frontend.torch.train import distribute_loss_inputs
from shardplan.ir.errors import PlanFileError
from shardplan.ir.table_wise import TableOwner
from shardplan.solver.planner import plan_graph
from shardplan.solver.serialize import plan_from_json
from test_recsys import _bce, _captured, _device_mesh
from torch import nn

pytestmark = [pytest.mark.torch]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    """One intra-op thread while simulated ranks run (as ``test_recsys.py``: measured there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


MESHES = {"8": {"dp": 8}, "2x4": {"dp": 2, "tp": 4}}
KINDS = {
    "table_wise": lambda: sp.strategies.embedding(table_wise=["emb.*"]),
    "table_wise_tp": lambda: sp.strategies.embedding(table_wise=["emb.*"], axes="tp"),
    "mixed": lambda: sp.strategies.embedding(
        table_wise=["emb.0", "emb.2"], row_wise=["emb.1"], column_wise=["emb.3"]
    ),
}
CELLS = [("8", "table_wise"), ("2x4", "table_wise"), ("2x4", "table_wise_tp"), ("2x4", "mixed")]


_PLANS: dict[tuple[str, str], tuple[sp.Plan, sp.Plan]] = {}


def _plan(mesh_name: str, kind: str) -> sp.Plan:
    """The cell's plan, its tables placed on owners (cached with the solve before placing)."""
    if (mesh_name, kind) not in _PLANS:
        _PLANS[(mesh_name, kind)] = _solve(mesh_name, kind)
    return _PLANS[(mesh_name, kind)][1]


def _solve(mesh_name: str, kind: str) -> tuple[sp.Plan, sp.Plan]:
    captured = _captured()
    mesh = sp.Mesh(MESHES[mesh_name], cluster="cpu-test")
    strategy = KINDS[kind]()
    saved = [(v, v.sharding, v.pinned) for v in captured.graph.values()]
    try:
        plan = plan_graph(captured.graph, mesh, pins=strategy.pins(captured.graph, mesh),
                          time_limit=30, semantics=captured.context.partial_semantics,
                          merge_followers=True)  # fmt: skip
    finally:
        for v, sharding, pinned in saved:
            v.sharding, v.pinned = sharding, pinned
    placed = strategy.finish(plan).with_context(captured.context)
    check_plan(__file__, f"{mesh_name}-{kind}", placed)
    return plan, placed


def _owner_rank(owner: TableOwner, device_mesh, mesh: sp.Mesh) -> tuple[int, list[int]]:  # type: ignore[no-untyped-def]
    """A global rank of the owner's group, and the ranks outside it."""
    ranks = device_mesh.mesh
    inside, outside = [], []
    for index in range(mesh.size):
        coordinate = [int(c) for c in torch.unravel_index(torch.tensor(index), ranks.shape)]
        held = owner.owns(dict(zip(mesh.axis_names, coordinate, strict=True)), mesh)
        (inside if held else outside).append(int(ranks[tuple(coordinate)]))
    return inside[0], outside


def _step(plan: sp.Plan, follow: bool) -> tuple:
    """One applied forward + backward: (loss, grads by name and rank reader, collectives)."""
    captured = _captured()
    device_mesh = _device_mesh(plan.mesh)
    with simulate.local_ranks(plan.mesh.size):
        sharded = plan.apply(copy.deepcopy(captured.model), device_mesh)
        (labels,) = distribute_loss_inputs(plan, device_mesh, (captured.labels,))
        log = simulate.CollectiveLog(device_mesh)
        replay = follow_plan(plan, device_mesh) if follow else contextlib.nullcontext()
        with log, replay as follower:
            loss = _bce(sharded(captured.dense, captured.ids, captured.offsets), labels)
            loss.backward()
        grads = dict(sharded.named_parameters())
        owners = {f"{o.module}.weight": o for o in plan.table_owners}
        checked = {}
        for name, p in grads.items():
            if name not in owners:
                checked[name] = (simulate.rank0(p.grad), [])
                continue
            rank, others = _owner_rank(owners[name], device_mesh, plan.mesh)
            checked[name] = (simulate.local_on(p.grad, rank),
                             [simulate.local_on(p.grad, r) for r in others])  # fmt: skip
        loss = simulate.rank0(loss)
    deviations = follower.deviations if follow else []
    return loss, checked, log.counts, deviations


def _check_numerics(loss: torch.Tensor, grads: dict) -> None:
    captured = _captured()
    torch.testing.assert_close(loss, captured.loss, rtol=1e-4, atol=1e-6)
    for name, want in captured.grads.items():
        got, elsewhere = grads[name]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)
        for other in elsewhere:  # a table-wise table's gradient lives on its owner only
            assert not other.any(), f"{name}: a gradient off its owner"


@pytest.mark.parametrize(("mesh", "kind"), CELLS, ids=["-".join(c) for c in CELLS])
def test_table_wise_plan_runs_as_planned(mesh: str, kind: str) -> None:
    plan = _plan(mesh, kind)
    named = KINDS[kind]().table_wise(plan.graph, plan.mesh)
    assert sorted(o.module for o in plan.table_owners) == sorted(named)
    assert len({(o.axes, o.owner) for o in plan.table_owners}) == len(named)  # one per device
    assert plan_from_json(plan.to_json()).table_owners == plan.table_owners
    loss, grads, _, _ = _step(plan, follow=False)
    _check_numerics(loss, grads)
    loss, grads, observed, deviations = _step(plan, follow=True)
    _check_numerics(loss, grads)
    planned = simulate.planned_collective_list(plan)
    assert observed == planned, (
        f"observed:\n{simulate.collective_listing(observed)}\n"
        f"planned:\n{simulate.collective_listing(planned)}\ndeviations: {deviations}"
    )
    exchanges = sum(n for (k, axes, _), n in planned.items() if k == "all-to-all")
    assert exchanges >= 2 * len(named)


def test_table_wise_plan_prices_the_owner() -> None:
    """On (8,): the tables' state on their owners only, their gradients' collectives over dp
    gone, a scatter and a gather of each lookup's whole pooled block (256 bags x 16 x f32)."""
    plan = _plan("8", "table_wise")
    solved, _ = _PLANS[("8", "table_wise")]
    tables = {v.name: v for v in plan.graph.inputs if v.origin.path.startswith("emb.")
              and v.origin.path.endswith(".weight")}  # fmt: skip
    whole = sum(v.type.nbytes for v in tables.values())
    largest = max(v.type.nbytes for v in tables.values())  # one table per device
    assert plan.memory["parameters"] == solved.memory["parameters"] - whole + largest
    grads = {op.results[0].name for op in plan.graph.ops if op.kind == "embedding_bag_backward"}
    assert grads
    assert [r for r in solved.reshards if r.value in grads and r.collectives]  # reduced over dp
    assert not [r for r in plan.reshards if r.value in grads and r.collectives]
    planned = simulate.planned_collective_list(plan)
    assert planned[("all-to-all", ("dp",), 256 * 16 * 4)] >= 2 * len(tables)
    assert plan.peak_memory_bytes < solved.peak_memory_bytes


def test_table_wise_plan_file_with_a_bad_owner_is_refused() -> None:
    document = json.loads(_plan("8", "table_wise").to_json())
    document["table_owners"][0]["owner"] = 8
    with pytest.raises(PlanFileError, match=r"table_owners\[0\].*owner 8 out of range"):
        plan_from_json(document)


class _Odd(nn.Module):
    """A max-pooling table and a table read with per-sample weights."""

    def __init__(self) -> None:
        super().__init__()
        self.maxed = nn.EmbeddingBag(16, 4, mode="max")
        self.weighted = nn.EmbeddingBag(16, 4, mode="sum")

    def forward(self, ids, offsets, psw):  # type: ignore[no-untyped-def]
        return self.maxed(ids, offsets) + self.weighted(ids, offsets, per_sample_weights=psw)


def test_table_wise_strategy_errors_name_the_table_and_the_fix() -> None:
    ids, offsets = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.tensor([0, 2, 4, 6])
    graph, _ = capture(_Odd(), ids, offsets, torch.ones(8), stamp_layers=False)
    mesh = sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test")
    with pytest.raises(sp.strategies.StrategyError, match=r"'maxed' is looked up with \['max'\]"):
        sp.strategies.embedding(table_wise=["maxed"]).pins(graph, mesh)
    with pytest.raises(sp.strategies.StrategyError, match=r"'weighted'.*per-sample weights"):
        sp.strategies.embedding(table_wise=["weighted"]).pins(graph, mesh)
    base = dataclasses.replace(sp.strategies.dp(), dp=("dp",))  # tp is no data axis
    with pytest.raises(sp.strategies.StrategyError, match=r"placed along \['tp'\].*data axes"):
        sp.strategies.embedding(table_wise={"weighted": ("tp",)}, base=base).table_wise(graph, mesh)
