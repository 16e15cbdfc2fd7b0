"""Property: applied plans of small lookup/gather/scatter graphs equal the plain model.

One tiny module holds a table per index op - an embedding with relative-position ids computed
inside ``forward`` (T5's bucket lookup), an embedding with ids computed from the input,
``index_select``, ``gather``, ``index_add`` and ``scatter_add`` - and is captured once. Each
example draws how the tables are pinned (rows over both mesh axes, rows over one and columns
over the other, ...; every layout splits every table), whether the step runs under
``plan.apply`` alone or ``follow_plan``, and the data; the loss and every gradient must equal
the plain model's (rtol 1e-4). Plans are cached per layout and the applied module per (layout,
mode), so an example costs one simulated forward + backward.
"""

from __future__ import annotations

import contextlib
import copy
from functools import cache

import pytest
import shardplan as sp
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.follow import follow_plan
from shardplan.ir import Sharding
from shardplan.solver.planner import plan_graph
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

pytestmark = [pytest.mark.torch, pytest.mark.slow]

ROWS, WIDTH, BATCH, SEQ = 16, 8, 4, 4
TABLES = ("relative", "computed", "selected", "gathered", "added", "scattered")
LAYOUTS = {
    "rows_dp_tp": ((("dp", "tp"), ()),),
    "rows_dp_cols_tp": ((("dp",), ("tp",)),),
    "rows_tp_cols_dp": ((("tp",), ("dp",)),),
    "rows_tp": ((("tp",), ()),),
}
"""Each layout pins every table to that sharding (rows, columns)."""
MESH = sp.Mesh({"dp": 2, "tp": 2})
EXAMPLES = 500
"""One example is one simulated forward + backward on 4 ranks (``LocalTensorMode``), about
0.3 s on the shared 2-core machine (issue 37 asks for at least 500 per CI run; 500 were also
run by hand once, all green, in 700 s under a load of ~11)."""


class _Lookups(nn.Module):
    """One table per index op; the sum of what they give feeds a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        for name in TABLES:
            self.register_parameter(name, nn.Parameter(torch.randn(ROWS, WIDTH)))
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(SEQ, device=ids.device)
        relative = (pos[None, :] - pos[:, None]).abs() % ROWS  # computed bucket ids
        h = x + F.embedding(relative, self.relative).sum(1)[None]
        h = h + F.embedding((ids * 3 + 1) % ROWS, self.computed)
        flat = ids.reshape(-1)
        h = h + self.selected.index_select(0, flat).reshape(BATCH, SEQ, WIDTH)
        spread = flat[:, None].expand(-1, WIDTH)
        h = h + torch.gather(self.gathered, 0, spread).reshape(BATCH, SEQ, WIDTH)
        src = self.proj(x).reshape(-1, WIDTH)
        h = h + self.added.index_add(0, flat, src)[ids]
        h = h + self.scattered.scatter_add(0, spread, src)[ids]
        return self.proj(h).square().mean()


@cache
def _captured() -> tuple:
    torch.manual_seed(0)
    model = _Lookups()
    example = _data(0)
    graph, context = capture(model, *example, stamp_layers=False)
    return model, graph, context


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ROWS, (BATCH, SEQ), generator=generator)
    return ids, torch.randn(BATCH, SEQ, WIDTH, generator=generator)


@cache
def _plan(layout: str) -> sp.Plan:
    _, graph, context = _captured()
    dims = LAYOUTS[layout][0]
    pins = {context.param_values[name]: Sharding(dims) for name in TABLES}
    saved = [(v, v.sharding, v.pinned) for v in graph.values()]
    try:
        plan = plan_graph(graph, MESH, pins=pins, time_limit=10,
                          semantics=context.partial_semantics)  # fmt: skip
    finally:
        for v, sharding, pinned in saved:
            v.sharding, v.pinned = sharding, pinned
    plan.frontend_context = context
    return plan


@cache
def _device_mesh():  # type: ignore[no-untyped-def]
    simulate.simulated_world(MESH.size)
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


_APPLIED: dict[str, nn.Module] = {}


def _applied(layout: str) -> nn.Module:
    """The plan applied once per layout (inside ``local_ranks``; reused across examples)."""
    if layout not in _APPLIED:
        model = _captured()[0]
        _APPLIED[layout] = _plan(layout).apply(copy.deepcopy(model), _device_mesh())
    return _APPLIED[layout]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(layout=st.sampled_from(sorted(LAYOUTS)), follow=st.booleans(),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_lookup_graphs_apply_and_follow_match_plain_model(layout: str, follow: bool,
                                                          seed: int) -> None:  # fmt: skip
    model = _captured()[0]
    inputs = _data(seed)
    reference = copy.deepcopy(model)
    loss = reference(*inputs)
    loss.backward()
    plan = _plan(layout)
    with simulate.local_ranks(MESH.size):
        sharded = _applied(layout)
        for name in TABLES:  # the pins hold: every table is split
            assert any(isinstance(p, Shard) for p in getattr(sharded, name).placements), name
        sharded.zero_grad(set_to_none=True)
        replay = follow_plan(plan, _device_mesh()) if follow else contextlib.nullcontext()
        with replay:
            got = sharded(*inputs)
            got.backward()
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
    torch.testing.assert_close(simulate.rank0(got), loss.detach(), rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
