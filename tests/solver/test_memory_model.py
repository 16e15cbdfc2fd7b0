"""Memory model: hand-computed per-device bytes of a small MLP training step (DP, FSDP, TP)."""

from __future__ import annotations

import shardplan as sp
import shardplan.ir.models
from shardplan import strategies
from shardplan.api.evaluate import evaluate
from shardplan.ir import Graph, Role, Sharding
from shardplan.ir.builder import GraphBuilder
from shardplan.ir.models import adamw
from shardplan.passes.liveness import Phase, liveness

F32 = 4


def mlp_step(B: int = 8192, D: int = 256) -> Graph:
    """x -> relu(x w1) -> relu(. w2) -> sum of squares; backward; fused AdamW (all f32)."""
    b = GraphBuilder("mlp")
    x = b.input("x", (B, D))
    names = ("layers.0.mlp.up_proj.weight", "layers.1.mlp.down_proj.weight")
    ws = [b.param(name, (D, D)) for name in names]
    hs, acts, a = [], [], x
    for i, w in enumerate(ws):
        with b.scope(f"layers.{i}"):
            hs.append(b.dot(a, w))
            acts.append(a)
            a = b.relu(hs[-1])
    loss = b.reduce_sum(b.mul(a, a), axes=(0, 1))
    g = b.add(a, a)
    grads = {}
    for i in reversed(range(2)):
        with b.scope(f"layers.{i}"):
            gh = b.op("relu_backward", [g, hs[i]], [hs[i].type])
            grads[i] = b.op("einsum", [acts[i], gh], [ws[i].type], equation="bi,bj->ij")
            if i:
                g = b.op("einsum", [gh, ws[i]], [acts[i].type], equation="bj,ij->bi")
    outputs, aliases = [loss], {}
    for i, w in enumerate(ws):
        m = b.input(f"{w.origin.path}#exp_avg", (D, D), role=Role.OPTIMIZER_STATE)
        v = b.input(f"{w.origin.path}#exp_avg_sq", (D, D), role=Role.OPTIMIZER_STATE)
        for new, old in zip(adamw(b, w, grads[i], m, v), (w, m, v), strict=True):
            aliases[len(outputs)] = b.graph.inputs.index(old)
            outputs.append(new)
    b.output(*outputs, aliases=aliases)
    return b.build()


def _evaluate(strategy, axis: str, B: int = 8192, D: int = 256):
    mesh = sp.Mesh({axis: 4}, cluster="h100-sxm")
    return evaluate(mlp_step(B, D), mesh=mesh, strategy=strategy)


def test_liveness_phases_and_saved_activations() -> None:
    graph = mlp_step()
    live = liveness(graph)
    kinds = [(op.kind, live.phase[i]) for i, op in enumerate(graph.ops)]
    assert kinds[:6] == [
        (k, Phase.FORWARD) for k in ("dot", "relu", "dot", "relu", "mul", "reduce_sum")
    ]
    assert [p for _, p in kinds[6:12]] == [Phase.BACKWARD] * 6
    assert [p for _, p in kinds[12:]] == [Phase.UPDATE] * 2
    h1 = graph.ops[0].result
    assert (live.define[h1], live.last_use[h1]) == (0, 10)  # saved for relu_backward of layer 0
    layer0 = live.layers["layers.0"]
    assert (layer0.forward_end, layer0.backward_start) == (1, 10)
    assert [v.name for v in layer0.saved["full"]] == [h1.name]


def test_data_parallel_bytes() -> None:
    ev = _evaluate(strategies.dp(), "dp")  # B=8192, D=256 on 4 devices
    act, w = 8192 * 256 * F32 // 4, 256 * 256 * F32  # a batch-split activation, a weight
    # Peak at the loss: x's shard, h1, a1, h2, a2, a2*a2 (batch-split), the scalar loss,
    # and replicated weights and moments.
    assert ev.peak_memory_bytes == act + 5 * act + F32 + 2 * w + 4 * w
    assert ev.memory == {
        "parameters": 2 * w, "optimizer_states": 4 * w, "activations": 5 * act + F32,
        "inputs": act,
    }  # fmt: skip


def test_fsdp_bytes() -> None:
    ev = _evaluate(strategies.fsdp(), "dp")
    act, w = 8192 * 256 * F32 // 4, 256 * 256 * F32
    assert ev.peak_memory_bytes == act + 5 * act + F32 + (2 * w + 4 * w) // 4
    assert ev.memory["parameters"] == 2 * w // 4
    assert ev.memory["optimizer_states"] == 4 * w // 4


def test_tensor_parallel_bytes() -> None:
    ev = _evaluate(strategies.megatron("tp"), "tp", B=64, D=4096)
    plan = ev.plan
    assert plan.sharding_of("layers_0_mlp_up_proj_weight") == Sharding.of(None, "tp")  # column
    assert plan.sharding_of("layers_1_mlp_down_proj_weight") == Sharding.of("tp", None)  # row
    x, w, g_h1 = 64 * 4096 * F32, 4096 * 4096 * F32 // 4, 64 * 4096 * F32 // 4
    # Peak at the end of backward: replicated x, weight, moment and gradient shards (the
    # gradients already reduced into the update's layout), g_h1 and the loss.
    assert ev.peak_memory_bytes == x + 2 * w + 4 * w + 2 * w + g_h1 + F32
    assert ev.memory["gradients"] == 2 * w
    assert ev.memory_breakdown().top[0][1] == "gradients"
