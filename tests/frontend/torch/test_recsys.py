"""Embedding bags (``nn.EmbeddingBag``) captured, planned and run as planned: a tiny DLRM.

The DLRM has 4 tables (64-256 rows x 16, sum and mean pooling, jagged ids with offsets), a
bottom MLP for the dense features, a dot interaction (``bmm`` of the stacked features, the
lower triangle), a top MLP and a BCE-with-logits loss. Each cell plans it on a mesh - free, or
with the tables pinned row-wise, column-wise or data-parallel (``sp.strategies.embedding``)
- and checks one training step on simulated ranks:

- ``plan.apply``, then ``apply`` + ``follow_plan``: loss and every gradient equal the plain
  model's (rtol 1e-4);
- under ``follow_plan`` the collectives issued (kind, mesh axes, bytes) are the plan's own;
- the plan shards a table (its rows or columns) or splits its lookups' bags.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import Counter

import pytest
import shardplan as sp
import torch
from plan_digests import check_plan
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.follow import follow_plan
from shardplan.frontend.torch.train import distribute_loss_inputs
from shardplan.ir import UnsupportedOpWarning
from shardplan.solver.planner import plan_graph
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

pytestmark = [pytest.mark.torch]

TABLES = ((64, "sum"), (128, "mean"), (256, "sum"), (96, "mean"))
DIM, DENSE, BATCH = 16, 8, 256
"""A batch where sharding pays on the cpu-test cluster: at 16 the free plan on (8,) replicates
every table (measured); at 256 it splits their columns."""


class DLRM(nn.Module):
    def __init__(self, tables=TABLES, dim: int = DIM) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.emb = nn.ModuleList(nn.EmbeddingBag(n, dim, mode=m) for n, m in tables)
        self.bottom = nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, dim), nn.ReLU())
        f = len(tables) + 1
        self.top = nn.Sequential(nn.Linear(f * (f - 1) // 2 + dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, ids: list, offsets: list) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = [e(i, o) for e, i, o in zip(self.emb, ids, offsets, strict=True)]
        feats = torch.stack([x, *pooled], 1)
        z = torch.bmm(feats, feats.transpose(1, 2))
        n = feats.shape[1]
        li, lj = torch.tril_indices(n, n, offset=-1)
        return self.top(torch.cat([x, z[:, li, lj]], 1)).squeeze(1)


def _bce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(out, y)


def dlrm_inputs(batch: int = BATCH, pooling: int = 3, seed: int = 0) -> tuple:
    """Dense features, per table jagged ids (1 to 2 x pooling per bag) and offsets, labels."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, DENSE, generator=g)
    ids, offsets = [], []
    for rows, _ in TABLES:
        lengths = torch.randint(1, 2 * pooling, (batch,), generator=g)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))
        ids.append(torch.randint(0, rows, (int(lengths.sum()),), generator=g))
    return dense, ids, offsets, torch.randint(0, 2, (batch,), generator=g).float()


class Captured:
    """The DLRM captured once, and its plain step's loss and gradients."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = DLRM()
        self.dense, self.ids, self.offsets, self.labels = dlrm_inputs()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnsupportedOpWarning)
            self.graph, self.context = capture(
                self.model, self.dense, self.ids, self.offsets, loss_fn=_bce,
                loss_inputs=(self.labels,), stamp_layers=False,
            )  # fmt: skip
        reference = copy.deepcopy(self.model)
        loss = _bce(reference(self.dense, self.ids, self.offsets), self.labels)
        loss.backward()
        self.loss = loss.detach()
        self.grads = {n: p.grad.detach() for n, p in reference.named_parameters()}


_CAPTURED: list[Captured] = []


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    """One intra-op thread while simulated ranks run: on the shared 2-core machine the
    parallel CPU ``index_add`` of the bag backward took 0.8 s a call with the default threads
    (an applied step 17 s), 1.6 s the whole step with one (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _captured() -> Captured:
    if not _CAPTURED:
        _CAPTURED.append(Captured())
    return _CAPTURED[0]


MESHES = {"8": {"dp": 8}, "2x4": {"dp": 2, "tp": 4}}
KINDS = {
    "free": None,
    "row_wise": lambda: sp.strategies.embedding(row_wise=["emb.*"]),
    "column_wise": lambda: sp.strategies.embedding(column_wise=["emb.*"]),
    "data_parallel": lambda: sp.strategies.embedding(data_parallel=["emb.*"]),
    "mixed": lambda: sp.strategies.embedding(
        row_wise={"emb.0": ("dp",), "emb.2": ("dp",)},
        column_wise={"emb.1": ("dp",)},
        data_parallel=["emb.3"],
    ),
}
CELLS = [(mesh, kind) for mesh in MESHES for kind in KINDS]


def _plan(captured: Captured, mesh_name: str, kind: str) -> sp.Plan:
    mesh = sp.Mesh(MESHES[mesh_name], cluster="cpu-test")
    strategy = KINDS[kind]
    pins = None if strategy is None else strategy().pins(captured.graph, mesh)
    saved = [(v, v.sharding, v.pinned) for v in captured.graph.values()]
    try:
        plan = plan_graph(
            captured.graph, mesh, pins=pins, time_limit=30,
            semantics=captured.context.partial_semantics,
            merge_followers=None if kind == "free" else True,
        )  # fmt: skip
    finally:
        for v, sharding, pinned in saved:
            v.sharding, v.pinned = sharding, pinned
    plan = plan.with_context(captured.context)
    check_plan(__file__, f"{mesh_name}-{kind}", plan)
    return plan


_DEVICE_MESHES: dict[tuple, object] = {}


def _device_mesh(mesh: sp.Mesh):  # type: ignore[no-untyped-def]
    key = tuple(mesh.axes)
    if key not in _DEVICE_MESHES:
        simulate.simulated_world(mesh.size)
        sizes = tuple(mesh.shape[a] for a in mesh.axis_names)
        _DEVICE_MESHES[key] = init_device_mesh("cpu", sizes, mesh_dim_names=mesh.axis_names)
    return _DEVICE_MESHES[key]


def _step(plan: sp.Plan, captured: Captured, follow: bool) -> tuple:
    """One forward + backward of the applied plan: (loss, grads, collectives, deviations)."""
    device_mesh = _device_mesh(plan.mesh)
    with simulate.local_ranks(plan.mesh.size):
        sharded = plan.apply(copy.deepcopy(captured.model), device_mesh)
        (labels,) = distribute_loss_inputs(plan, device_mesh, (captured.labels,))
        log = simulate.CollectiveLog(device_mesh)
        replay = follow_plan(plan, device_mesh) if follow else contextlib.nullcontext()
        with log, replay as follower:
            loss = _bce(sharded(captured.dense, captured.ids, captured.offsets), labels)
            loss.backward()
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
    deviations = follower.deviations if follow else []
    return simulate.rank0(loss), grads, log.counts, deviations


def _check_numerics(captured: Captured, loss: torch.Tensor, grads: dict) -> None:
    torch.testing.assert_close(loss, captured.loss, rtol=1e-4, atol=1e-6)
    for name, want in captured.grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)


def _sharded_lookups(plan: sp.Plan) -> list[str]:
    """Table modules whose table is split (rows or columns) or whose lookup splits its bags."""
    out = []
    for i, op in enumerate(plan.graph.ops):
        if op.kind != "embedding_bag":
            continue
        table = plan.operand_shardings.get((i, 0), plan.shardings[op.operands[0].name])
        stored = plan.shardings[op.operands[0].name]
        result = plan.shardings[op.results[0].name]
        if table.used_axes or stored.used_axes or result.dims[0]:
            out.append(op.origin.module)
    return out


@pytest.mark.parametrize(("mesh", "kind"), CELLS, ids=["-".join(c) for c in CELLS])
def test_dlrm_plan_runs_as_planned(mesh: str, kind: str) -> None:
    """apply, then apply + follow_plan: the plain model's numerics, the plan's collectives."""
    captured = _captured()
    plan = _plan(captured, mesh, kind)
    assert _sharded_lookups(plan), "the plan shards no table and splits no lookup"
    loss, grads, _, _ = _step(plan, captured, follow=False)
    _check_numerics(captured, loss, grads)
    loss, grads, observed, deviations = _step(plan, captured, follow=True)
    _check_numerics(captured, loss, grads)
    planned = simulate.planned_collective_list(plan)
    assert observed == planned, (
        f"observed:\n{simulate.collective_listing(observed)}\n"
        f"planned:\n{simulate.collective_listing(planned)}\ndeviations: {deviations}"
    )
    assert not [d for d in deviations if "bag" in d], deviations


def test_dlrm_pinned_layouts_are_the_strategys() -> None:
    """The strategy's pins reach the plan: rows / columns split as named, ids read whole."""
    captured = _captured()
    plan = _plan(captured, "2x4", "mixed")
    layouts = {v.origin.path: str(plan.shardings[v.name]) for v in plan.graph.inputs}
    assert layouts["emb.0.weight"] == layouts["emb.2.weight"] == '[{"dp"}, {}]'
    assert layouts["emb.1.weight"] == '[{}, {"dp"}]'
    assert layouts["emb.3.weight"] == "[{}, {}]"
    assert layouts["ids[0]"] == layouts["offsets[0]"] == "[{}]"
    kinds = Counter(op.kind for op in plan.graph.ops)
    assert kinds["embedding_bag"] == kinds["embedding_bag_backward"] == 4


class _TorchRec(nn.Module):
    """A torchrec ``EmbeddingBagCollection`` (sum and mean tables) read by a linear head."""

    def __init__(self) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        super().__init__()
        tables = [
            EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=64,
                               feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=128,
                               feature_names=["f1"], pooling=PoolingType.MEAN),
        ]  # fmt: skip
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        self.top = nn.Linear(32, 1)

    def forward(self, features):  # type: ignore[no-untyped-def]
        return self.top(self.ebc(features).values()).squeeze(1)


def test_torchrec_collection_with_a_keyed_jagged_tensor_runs_as_planned() -> None:
    """The KJT's values and lengths are the example inputs; the collection's tables lower to
    ``embedding_bag``s, pinned row-wise and column-wise; apply and follow_plan match."""
    from torchrec import KeyedJaggedTensor

    torch.manual_seed(0)
    model = _TorchRec()
    lengths = torch.tensor([1, 2, 1, 1, 2, 0, 1, 2])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.randint(0, 64, (10,)), lengths=lengths
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedOpWarning)
        graph, context = capture(model, kjt, stamp_layers=False)
    assert [v.origin.path for v in graph.inputs if v.role.name == "INPUT"] == [
        "features.values", "features.lengths",
    ]  # fmt: skip
    reference = copy.deepcopy(model)
    want = (reference(kjt) ** 2).mean()  # the capture's default loss
    want.backward()
    mesh = sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test")
    strategy = sp.strategies.embedding(
        row_wise=["ebc.embedding_bags.t0"], column_wise=["ebc.embedding_bags.t1"], axes="tp"
    )
    plan = plan_graph(graph, mesh, pins=strategy.pins(graph, mesh), time_limit=20,
                      semantics=context.partial_semantics, merge_followers=True)  # fmt: skip
    plan = plan.with_context(context)
    lookups = [op for op in graph.ops if op.kind == "embedding_bag"]
    assert [str(plan.shardings[op.results[0].name]) for op in lookups] == [
        '[{}, {}] partial={"tp"}', '[{}, {"tp"}]',
    ]  # fmt: skip
    device_mesh = _device_mesh(mesh)
    for follow in (False, True):
        with simulate.local_ranks(mesh.size):
            sharded = plan.apply(copy.deepcopy(model), device_mesh)
            log = simulate.CollectiveLog(device_mesh)
            replay = follow_plan(plan, device_mesh) if follow else contextlib.nullcontext()
            with log, replay:
                loss = (sharded(kjt) ** 2).mean()
                loss.backward()
            grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
        torch.testing.assert_close(simulate.rank0(loss), want.detach(), rtol=1e-4, atol=1e-6)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
        if follow:
            assert log.counts == simulate.planned_collective_list(plan)
