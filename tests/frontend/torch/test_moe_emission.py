"""Mixture-of-experts plans applied on 8 simulated ranks (``LocalTensorMode``: real numerics).

A tiny HF Mixtral (8 experts, top-2) planned on ``{"dp": 2, "ep": 4}``, free and pinned to
expert parallelism over ``ep`` (``sp.strategies.expert_parallel("ep")``): the expert weights
are DTensors split on their expert dim over ``ep``; one training step of ``plan.apply`` and
of ``apply`` + ``follow_plan`` equals the plain model's (loss and every gradient, rtol 1e-4);
under ``follow_plan`` the collectives run equal the cost model's (kind, mesh axes, bytes),
all-to-alls included (token dispatch and combine). Also followed on (4, 2) and (2, 2, 2) pinned
to EP and for the free plan on (2, 2, 2).
"""

from __future__ import annotations

import collections
import contextlib
import copy

import pytest
import shardplan as sp
import torch
from moe_models import BATCH, SEQ, VOCAB, tiny_mixtral
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.follow import follow_plan
from shardplan.frontend.torch.train import step_loss
from shardplan.solver.planner import plan_graph
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

pytestmark = [pytest.mark.torch, pytest.mark.slow]

MESH = {"dp": 2, "ep": 4}


@pytest.fixture(scope="module")
def family():  # type: ignore[no-untyped-def]
    model = tiny_mixtral()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    inputs = ({"input_ids": ids, "labels": ids},)
    graph, context = capture(model, *inputs, stamp_layers=False)  # dropless: HF's numerics
    reference = copy.deepcopy(model)
    reference.config._experts_implementation = "eager"  # HF's own experts loop
    loss = step_loss(reference, inputs)
    loss.backward()
    grads = {n: p.grad.detach() for n, p in reference.named_parameters()}
    simulate.simulated_world(8)
    device_mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "ep"))
    return model, inputs, graph, context, loss.detach(), grads, device_mesh


def _plan(family, kind: str, axes: dict[str, int] = MESH) -> sp.Plan:  # type: ignore[no-untyped-def]
    _, _, graph, context, _, _, _ = family
    mesh = sp.Mesh(axes, cluster="cpu-test")  # a tiny model splits only where compute is slow
    pins = None
    if kind == "ep":
        pins = sp.strategies.expert_parallel("ep").pins(graph, mesh)
    saved = [(v, v.sharding, v.pinned) for v in graph.values()]
    try:
        plan = plan_graph(graph, mesh, pins=pins, time_limit=60,
                          semantics=context.partial_semantics)  # fmt: skip
    finally:
        for v, sharding, pinned in saved:
            v.sharding, v.pinned = sharding, pinned
    plan = plan.with_context(context)
    return plan


def _step(plan: sp.Plan, family, follow: bool, device_mesh=None):  # type: ignore[no-untyped-def]
    model, inputs, _, _, _, _, family_mesh = family
    device_mesh = device_mesh or family_mesh
    with simulate.local_ranks(8):
        sharded = plan.apply(copy.deepcopy(model), device_mesh)
        experts = {n: p for n, p in sharded.named_parameters() if "experts" in n}
        log = simulate.CollectiveLog(device_mesh)
        replay = follow_plan(plan, device_mesh) if follow else contextlib.nullcontext()
        with log, replay as follower:
            loss = step_loss(sharded, inputs)
            loss.backward()
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
    deviations = follower.deviations if follow else []
    return simulate.rank0(loss), grads, log.counts, experts, deviations


def _by_kind(counts: collections.Counter) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for (kind, _, _), n in counts.items():
        out[kind] += n
    return out


@pytest.fixture(scope="module")
def ran(family):  # type: ignore[no-untyped-def]
    """The EP-pinned plan, one step under ``apply`` and one under ``follow_plan``."""
    plan = _plan(family, "ep")
    return plan, _step(plan, family, follow=False), _step(plan, family, follow=True)


@pytest.mark.parametrize("follow", [False, True], ids=["apply", "follow_plan"])
def test_moe_plan_runs_like_the_plain_model(family, ran, follow: bool) -> None:  # type: ignore[no-untyped-def]
    _, _, _, _, want_loss, want_grads, device_mesh = family
    plan, *steps = ran
    loss, grads, _, experts, _ = steps[follow]
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-6)
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)
    ep = device_mesh.mesh_dim_names.index("ep")
    assert experts
    for name, p in experts.items():  # expert weights: DTensors split on dim 0 over ep
        assert isinstance(p, DTensor), name
        assert "ep" in plan.parameter_shardings()[name].dims[0]
        assert p.placements[ep] == Shard(0), (name, p.placements)


def test_follow_plan_moves_tokens_by_all_to_all(ran) -> None:  # type: ignore[no-untyped-def]
    """The plan moves tokens by all-to-all over ep (dispatch and combine, forward and
    backward), and the step that runs does too (exact counts: the test below)."""
    plan, _, (_, _, observed, _, _) = ran
    planned = simulate.planned_collective_list(plan)
    over_ep = [k for k in planned if k[0] == "all-to-all"]
    assert {k[1] for k in over_ep} == {("ep",)}
    assert sum(planned[k] for k in over_ep) >= 2
    assert sum(n for k, n in observed.items() if k[:2] == ("all-to-all", ("ep",))) >= 2


def test_follow_plan_collective_counts_by_kind(ran) -> None:  # type: ignore[no-untyped-def]
    """Under follow_plan the collectives run are the cost model's: by kind (all-to-alls
    included) and, as for the dense families of ``test_emission_matrix.py``, by kind, mesh
    axes and bytes. The follower replays the ``shardplan::moe_*`` calls too (forward and the
    custom ops' backward), so DTensor picks no layout of its own."""
    plan, _, (_, _, observed, _, deviations) = ran
    planned = simulate.planned_collective_list(plan)
    listing = (
        f"observed:\n{simulate.collective_listing(observed)}\n"
        f"planned:\n{simulate.collective_listing(planned)}\ndeviations: {deviations}"
    )
    assert _by_kind(observed) == _by_kind(planned), listing
    assert observed == planned, listing


OTHER_MESHES = {
    "4x2-ep": ({"dp": 4, "ep": 2}, "ep"),
    "2x2x2-ep": ({"dp": 2, "ep": 2, "tp": 2}, "ep"),
    "2x2x2-free": ({"dp": 2, "ep": 2, "tp": 2}, "free"),
}
"""Other mesh shapes, ``follow_plan`` only. EP pinned on (2, 2, 2) moves the token ids from a
``(dp, ep, tp)`` to an ``(ep, tp)`` split by a collective-permute and an all-gather over
``dp`` (and back for the embedding's backward): the follower runs them as priced
(``frontend/torch/reshard.py``; ``test_reshard_permute.py`` has the reshards alone)."""


@pytest.mark.parametrize("cell", list(OTHER_MESHES))
def test_follow_plan_on_other_meshes(family, cell: str) -> None:  # type: ignore[no-untyped-def]
    """(4, 2) and (2, 2, 2) pinned to EP over ``ep``, and the free plan on (2, 2, 2) (experts
    over all three axes, attention split over ``tp``): the step under ``follow_plan`` equals
    the plain model's, the expert weights are DTensors split on the expert dim, and the
    collectives run are the cost model's (kind, axes, bytes; collective-permutes included),
    whichever way the plan pays for the experts' split over ``ep``."""
    _, _, _, _, want_loss, want_grads, _ = family
    axes, kind = OTHER_MESHES[cell]
    device_mesh = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    plan = _plan(family, kind, axes)
    loss, grads, observed, experts, deviations = _step(plan, family, True, device_mesh)
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-6)
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)
    assert experts
    for name, p in experts.items():
        split = plan.parameter_shardings()[name].dims[0]
        assert "ep" in split, (name, split)
        assert isinstance(p, DTensor), name
        assert all(p.placements[i] == Shard(0) for i, a in enumerate(axes) if a in split), name
    planned = simulate.planned_collective_list(plan)
    # experts split over ep: the planner, by cost, moves the tokens to them (all-to-all) or
    # them to the tokens (all-gather of the weights over ep, reduce-scatter of their gradients:
    # the cheaper on (4, 2) for these tiny experts on the cpu-test cluster); either way the
    # collectives run are the planned ones (the last assert)
    over_ep = {k[0] for k in planned if "ep" in k[1]}
    assert "all-to-all" in over_ep or {"all-gather", "reduce-scatter"} <= over_ep, over_ep
    if cell == "2x2x2-ep":  # the token ids' permute (the case this cell is here for)
        assert any(k[0] == "collective-permute" for k in planned)
    assert observed == planned, (
        f"observed:\n{simulate.collective_listing(observed)}\n"
        f"planned:\n{simulate.collective_listing(planned)}\ndeviations: {deviations}"
    )
