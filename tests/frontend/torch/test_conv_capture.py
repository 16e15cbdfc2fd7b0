"""Capture of convolutional models: unknown multi-output ops, conv/pool lowerings."""

from __future__ import annotations

import operator
import warnings

import pytest
import shardplan as sp
import torch
import torch.nn.functional as F
from shardplan.frontend.torch.lower import Lowering, add_input, lower_node
from shardplan.ir import Graph, Role
from torch import fx, nn

pytestmark = pytest.mark.torch


def frobnicate_multi(x: torch.Tensor):  # type: ignore[no-untyped-def]  # pragma: no cover
    return (None, x, None, x)  # traced only: no lowering exists for it


def test_unknown_multi_output_op_keeps_none_positions() -> None:
    """An op without a lowering whose outputs include None (``convolution_backward`` without an
    input gradient) keeps every output at its index: ``getitem(op, 3)`` is the 4th output."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3)
    call = g.call_function(frobnicate_multi, (x,))
    call.meta["val"] = (None, torch.empty(2, 3), None, torch.empty(4, 3))
    picks = [g.call_function(operator.getitem, (call, i)) for i in range(4)]
    graph = Graph("t")
    low = Lowering(graph)
    add_input(low, x, Role.INPUT, "x")
    with pytest.warns(sp.UnsupportedOpWarning, match="frobnicate_multi"):
        lower_node(low, call)
    for node in picks:
        lower_node(low, node)
    got = [low.env[n] for n in picks]
    assert got[0] is None
    assert got[2] is None
    assert got[1].type.shape == (2, 3)
    assert got[3].type.shape == (4, 3)
    (op,) = [op for op in graph.ops if op.kind == "aten.frobnicate_multi"]
    assert [r.type.shape for r in op.results] == [(2, 3), (4, 3)]


# -- the convolution rules hold for torch's kernels ---------------------------------------------


def _half(t: torch.Tensor, dims, sizes: dict, factor: str, k: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Shard ``k`` of 2 of ``t`` along ``factor`` (a compound dim is split on its factor)."""
    for d, dim in enumerate(dims):
        if factor not in dim:
            continue
        shape = list(t.shape)
        inner = [sizes[f] for f in dim]
        t = t.reshape(*shape[:d], *inner, *shape[d + 1 :])
        at = d + dim.index(factor)
        t = t.narrow(at, k * sizes[factor] // 2, sizes[factor] // 2)
        shape[d] //= 2
        t = t.reshape(shape)
    return t


def _check_every_factor(rule, fn, operands, attrs_for_half) -> list[str]:  # type: ignore[no-untyped-def]
    """Split each splittable factor of ``rule`` in two, run ``fn`` per shard, and compare with
    the unsplit results: carried -> the shard's slice, partial -> summed, else equal."""
    sizes = rule.size_of
    full = fn(operands, {})
    checked = []
    for f in rule.factor_names:
        in_operands = any(f in d for t in rule.operands for d in t)
        if f in rule.need_replication or sizes[f] % 2 or not in_operands:
            continue
        shards = []
        for k in range(2):
            parts = [
                _half(x, dims, sizes, f, k)
                for x, dims in zip(operands, rule.operands, strict=False)
            ]
            shards.append(fn(parts, attrs_for_half(f)))
        for r, dims in enumerate(rule.results):
            if full[r] is None:
                continue
            got = [s[r] for s in shards]
            if any(f in d for d in dims):
                want = [_half(full[r], dims, sizes, f, k) for k in range(2)]
                for a, b in zip(got, want, strict=False):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            elif f in rule.partial_factors(r):
                torch.testing.assert_close(got[0] + got[1], full[r], rtol=1e-4, atol=1e-4)
            else:
                torch.testing.assert_close(got[0], full[r], rtol=1e-4, atol=1e-4)
        checked.append(f)
    return checked


def _geo(stride=1, padding=0, dilation=1, groups=1, **more):  # type: ignore[no-untyped-def]
    return dict(stride=stride, padding=padding, dilation=dilation, groups=groups, **more)


CONVS = {
    "2d": ((4, 8, 9, 9), (6, 8, 3, 3), _geo(stride=2, padding=1)),
    "grouped-dilated": ((2, 8, 10, 10), (12, 4, 3, 3), _geo(padding=2, dilation=2, groups=2)),
    "depthwise": ((2, 8, 7, 7), (8, 1, 3, 3), _geo(padding=1, groups=8)),
    "1d": ((2, 4, 16), (6, 4, 5), _geo(stride=3)),
    "3d": ((2, 4, 5, 6, 6), (4, 4, 3, 3, 3), _geo(padding=1)),
    "transposed": (
        (2, 8, 5, 5), (8, 2, 3, 3),
        _geo(stride=2, padding=1, groups=2, transposed=True, output_padding=1),
    ),
}  # fmt: skip


def _conv_call(weight_shape, geo, groups_of):  # type: ignore[no-untyped-def]
    spatial = len(weight_shape) - 2

    def call(ins, half, backward=False):  # type: ignore[no-untyped-def]
        g = groups_of(half)
        args = (
            [geo["stride"]] * spatial, [geo["padding"]] * spatial, [geo["dilation"]] * spatial,
            geo.get("transposed", False), [geo.get("output_padding", 0)] * spatial, g,
        )  # fmt: skip
        if backward:
            grad, x, w = ins
            out = torch.ops.aten.convolution_backward(grad, x, w, [w.shape[0]], *args, [True] * 3)
            return list(out)
        return [torch.ops.aten.convolution(ins[0], ins[1], None, *args)]

    return call


@pytest.mark.parametrize("case", list(CONVS))
def test_conv_rules_hold_for_torch_kernels(case: str) -> None:
    """Every factor the forward and backward rules let split gives torch's own results."""
    from shardplan.frontend.torch.conv import conv_attrs
    from shardplan.ir import TensorType, rule_for

    x_shape, w_shape, geo = CONVS[case]
    torch.manual_seed(0)
    x, w = torch.randn(x_shape, dtype=torch.float64), torch.randn(w_shape, dtype=torch.float64)
    spatial = len(w_shape) - 2
    geometry = {"stride": (geo["stride"],) * spatial, "padding": (geo["padding"],) * spatial,
                "dilation": (geo["dilation"],) * spatial, "groups": geo["groups"],
                "transposed": geo.get("transposed", False),
                "output_padding": (geo.get("output_padding", 0),) * spatial}  # fmt: skip
    attrs = conv_attrs(TensorType(w_shape, "f64"), geometry)
    call = _conv_call(w_shape, geo, lambda half: half.get("groups", geo["groups"]))
    y = call([x, w], {})[0]
    types = [TensorType(tuple(t.shape), "f64") for t in (x, w, y)]
    rule = rule_for("convolution", types[:2], types[2:], attrs)
    group = rule.operands[0][1][0]  # major in the lhs feature dim (the group when G > 1)

    def halves(f):  # type: ignore[no-untyped-def]  # a split group factor halves the groups
        return {"groups": geo["groups"] // 2} if geo["groups"] > 1 and f == group else {}

    checked = _check_every_factor(rule, lambda ins, h: call(ins, h), [x, w], halves)
    assert len(checked) >= 3 if geo["groups"] == 1 else len(checked) >= 2
    grad = torch.randn_like(y)
    battrs = {"output_mask": (True, True, True), "transposed": geometry["transposed"],
              "feature_group_count": geo["groups"]}  # fmt: skip
    outs = call([grad, x, w], {}, backward=True)
    btypes = [TensorType(tuple(t.shape), "f64") for t in (grad, x, w, *outs)]
    brule = rule_for("convolution_backward", btypes[:3], btypes[3:], battrs)
    bchecked = _check_every_factor(
        brule, lambda ins, h: call(ins, h, backward=True), [grad, x, w], halves
    )
    assert set(brule.summed)
    assert len(bchecked) >= 2


# -- a planned CNN runs: loss and every gradient as the plain module -----------------------------


class PoolNet(nn.Module):
    """Strided, depthwise and transposed convolutions, max/avg/adaptive pools, nearest and
    bilinear resampling, pixel (un)shuffle and a global average pool."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, stride=2)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.line = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.stem(x)), 2)
        x = F.avg_pool2d(self.depthwise(x), 2)
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        x = F.interpolate(x, size=(6, 6), mode="bilinear", align_corners=False)
        x = F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2)
        x = F.adaptive_avg_pool2d(self.up(x), (3, 3))
        x = self.line(x.flatten(2))
        return self.head(F.adaptive_avg_pool2d(x[..., None], 1).flatten(1))


@pytest.mark.slow
def test_planned_cnn_follows_the_plan_with_plain_numerics() -> None:
    """Data parallel on 2 ranks (the solver moves the depthwise conv to a channel split):
    under ``follow_plan`` loss and every gradient equal the plain module's (rtol 1e-4)."""
    import copy

    from shardplan.frontend.torch import simulate
    from shardplan.frontend.torch.follow import follow_plan
    from shardplan.frontend.torch.train import step_loss
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, x = PoolNet(), torch.randn(4, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sp.UnsupportedOpWarning)
        plan = sp.evaluate(
            model, x, mesh=sp.Mesh({"dp": 2}, cluster="cpu-test"), strategy=sp.strategies.dp()
        ).plan
    kinds = {op.kind for op in plan.graph.ops}
    assert {"max_pool", "avg_pool_backward", "upsample", "pixel_shuffle"} <= kinds
    split = [
        op.kind
        for i, op in enumerate(plan.graph.ops)
        if op.kind.startswith(("convolution", "max_pool", "avg_pool", "upsample"))
        and plan.operand_shardings[(i, 0)].used_axes
    ]
    assert {"convolution", "convolution_backward", "avg_pool"} <= set(split)
    reference = copy.deepcopy(model)
    ref_loss = step_loss(reference, (x,))
    ref_loss.backward()
    simulate.simulated_world(2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with simulate.local_ranks(2):
        sharded = plan.apply(copy.deepcopy(model), mesh)
        with follow_plan(plan, mesh) as follower:
            loss = step_loss(sharded, (x,))
            loss.backward()
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
    assert not [d for d in follower.deviations if "conv" in d or "pool" in d]
    torch.testing.assert_close(simulate.rank0(loss), ref_loss.detach(), rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
