"""``nn.EmbeddingBag``'s options captured and run at split layouts on simulated ranks.

One module holds a max-pooling table, a mean table with ``padding_idx``, a sum table with
per-sample weights, a mean table read by a 2-D fixed-length input and an
``include_last_offset`` table; bags may be empty. Two pinned layouts on a (2, 2) mesh: every
lookup split (rows for the sum/mean tables: masked pooling into a pending sum; columns for the
max table) and the bags split over one axis with columns over the other. ``apply`` and
``follow_plan`` match the plain model, and follow's collectives are the plan's.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.follow import follow_plan
from shardplan.ir import FrontendError, Sharding, UnsupportedOpWarning
from shardplan.solver.planner import plan_graph
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

pytestmark = [pytest.mark.torch]

BAGS = 8
AXES = {"dp": 2, "tp": 2}


class Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.maxed = nn.EmbeddingBag(32, 8, mode="max")
        self.padded = nn.EmbeddingBag(40, 8, mode="mean", padding_idx=3)
        self.weighted = nn.EmbeddingBag(48, 8, mode="sum")
        self.fixed = nn.EmbeddingBag(24, 8, mode="mean")
        self.last = nn.EmbeddingBag(16, 8, mode="sum", include_last_offset=True)

    def forward(self, ids: list, offsets: list, psw: torch.Tensor, fixed: torch.Tensor):  # type: ignore[no-untyped-def]
        a = self.maxed(ids[0], offsets[0])
        b = self.padded(ids[1], offsets[1])
        c = self.weighted(ids[2], offsets[2], per_sample_weights=psw)
        d = self.fixed(fixed)
        e = self.last(ids[3], offsets[3])
        return torch.cat([a, b, c, d, e], 1).tanh().sum(1)


def _inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    ids, offsets = [], []
    for rows in (32, 40, 48, 16):
        lengths = torch.randint(0, 5, (BAGS,), generator=g)  # empty bags too
        ends = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        offsets.append(ends if rows == 16 else ends[:-1])
        ids.append(torch.randint(0, rows, (int(lengths.sum()),), generator=g))
    ids[1][::3] = 3  # the padding row
    psw = torch.rand(ids[2].shape[0], generator=g)
    return ids, offsets, psw, torch.randint(0, 24, (BAGS, 3), generator=g)


class Captured:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model, self.args = Bags(), _inputs()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnsupportedOpWarning)
            self.graph, self.context = capture(self.model, *self.args, stamp_layers=False)
        reference = copy.deepcopy(self.model)
        loss = (reference(*self.args) ** 2).mean()  # the capture's default loss
        loss.backward()
        self.loss = loss.detach()
        self.grads = {n: p.grad.detach() for n, p in reference.named_parameters()}


_CAPTURED: list[Captured] = []


def _captured() -> Captured:
    if not _CAPTURED:
        _CAPTURED.append(Captured())
    return _CAPTURED[0]


def _lookups(graph: sp.Graph) -> dict:
    return {op.origin.module: op for op in graph.ops if op.kind == "embedding_bag"}


def test_bag_options_lower_with_their_attributes() -> None:
    ops = _lookups(_captured().graph)
    assert ops["maxed"].attrs["mode"] == "max"
    assert len(ops["maxed"].results) == 2
    assert "a" in ops["maxed"].rule.need_replication  # max: the rows may not split
    assert ops["padded"].attrs["padding_idx"] == 3
    assert ops["weighted"].attrs["per_sample_weights"] is True
    assert ops["fixed"].attrs["fixed_bag"] == 3
    assert ops["fixed"].attrs["pooling"] == 3.0
    assert ops["last"].attrs["include_last_offset"] is True
    n = ops["padded"].operands[1].type.shape[0]
    assert ops["padded"].attrs["pooling"] == n / BAGS  # measured: ids per bag
    assert str(ops["fixed"].rule).startswith("ab,(cd),c->cb")  # bags split with their ids
    assert "reduction={a}" in str(ops["padded"].rule)  # rows: a pending sum


def _pins(captured: Captured, layout: str) -> dict:
    pins = {}
    for v in captured.graph.inputs:
        if v.role.name != "PARAMETER":
            continue
        maxed = v.origin.path.startswith("maxed")
        if layout == "rows":
            pins[v.name] = Sharding(((), ("dp", "tp")) if maxed else (("dp", "tp"), ()))
        else:
            pins[v.name] = Sharding(((), ("tp",)))
    for module, op in _lookups(captured.graph).items():
        out = op.results[0].name
        if layout == "rows":  # the lookups themselves split rows (columns for max)
            pins[out] = (Sharding(((), ("dp", "tp"))) if module == "maxed"
                         else Sharding(((), ()), frozenset({"dp", "tp"})))  # fmt: skip
        else:
            pins[out] = Sharding((("dp",), ("tp",)))
    return pins


def _run(layout: str) -> tuple:
    """Apply and follow the pinned plan: numerics checked; follow_plan's collectives and the
    plan's, returned."""
    captured = _captured()
    mesh = sp.Mesh(AXES, cluster="cpu-test")
    plan = plan_graph(captured.graph, mesh, pins=_pins(captured, layout), time_limit=20,
                      semantics=captured.context.partial_semantics,
                      merge_followers=True)  # fmt: skip
    plan = plan.with_context(captured.context)
    simulate.simulated_world(mesh.size)
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the parallel CPU index_add crawls on a loaded 2-core machine
    try:
        for follow in (False, True):
            with simulate.local_ranks(mesh.size):
                sharded = plan.apply(copy.deepcopy(captured.model), device_mesh)
                log = simulate.CollectiveLog(device_mesh)
                replay = follow_plan(plan, device_mesh) if follow else contextlib.nullcontext()
                with log, replay:
                    loss = (sharded(*captured.args) ** 2).mean()
                    loss.backward()
                grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
            torch.testing.assert_close(simulate.rank0(loss), captured.loss, rtol=1e-4, atol=1e-6)
            for name, want in captured.grads.items():
                torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        torch.set_num_threads(threads)
    return log.counts, simulate.planned_collective_list(plan)


_RESULTS: dict[str, tuple] = {}


def _results(layout: str) -> tuple:
    if layout not in _RESULTS:
        _RESULTS[layout] = _run(layout)
    return _RESULTS[layout]


@pytest.mark.parametrize("layout", ["rows", "bags"])
def test_bag_options_run_as_planned(layout: str) -> None:
    _results(layout)  # apply and follow_plan equal the plain model's loss and gradients


@pytest.mark.parametrize("layout", ["rows", "bags"])
def test_bag_options_follow_issues_the_planned_collectives(layout: str) -> None:
    """The max table's pooled rows are pinned split over dp, its max ids left whole (a free
    slice at the producer): follow_plan pools every bag there and slices the rows, as
    planned (it once pooled its own bags and all-gathered the max ids: 256 B unplanned)."""
    issued, planned = _results(layout)
    assert issued == planned


def test_pooling_keyword_sets_and_checks_the_factor() -> None:
    captured = _captured()
    model, args = captured.model, captured.args
    graph, _ = capture(model, *args, pooling={"padded": 20}, stamp_layers=False)
    assert {op.attrs["pooling"] for op in graph.ops if op.origin.module == "padded"
            and op.kind.startswith("embedding_bag")} == {20.0}  # fmt: skip
    with pytest.raises(FrontendError, match=r"no embedding bag lookup in module 'emb'.*'padded'"):
        capture(model, *args, pooling={"emb": 20}, stamp_layers=False)
    with pytest.raises(FrontendError, match="a positive number"):
        capture(model, *args, pooling={"padded": 0}, stamp_layers=False)


def test_embedding_strategy_errors_name_the_table() -> None:
    graph, mesh = _captured().graph, sp.Mesh(AXES, cluster="cpu-test")
    with pytest.raises(sp.strategies.StrategyError, match="'maxed' pools with max"):
        sp.strategies.embedding(row_wise=["maxed"]).pins(graph, mesh)
    with pytest.raises(sp.strategies.StrategyError, match=r"no embedding table in module 'emb\.9'"):
        sp.strategies.embedding(column_wise=["emb.9"]).pins(graph, mesh)
    with pytest.raises(sp.strategies.StrategyError, match="named row_wise and column_wise"):
        sp.strategies.embedding(row_wise=["padded"], column_wise=["pad*"]).pins(graph, mesh)
    with pytest.raises(sp.strategies.StrategyError, match="names no table"):
        sp.strategies.embedding()
    pins = sp.strategies.embedding(row_wise={"padded": ("tp",)}).pins(graph, mesh)
    weight = next(v for v in graph.inputs if v.origin.path == "padded.weight")
    assert str(pins[weight.name]) == '[{"tp"}, {}]'
