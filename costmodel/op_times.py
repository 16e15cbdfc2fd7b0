"""Each op's roofline seconds under a plan's layouts: local FLOPs and HBM bytes (fusion, halo
exchanges, attention and conv work factors, kernel launches), as the step simulation runs them."""

from __future__ import annotations

import math
from typing import Any, Protocol

from shardplan.costmodel.context_parallel import attention_work_factor
from shardplan.costmodel.conv import conv_work_factor, halo_time, layout_time
from shardplan.ir.graph import Graph, Op
from shardplan.ir.op_cost import op_bytes, op_flops

from .cluster import Cluster, cluster_of
from .compute import compute_time
from .engine import launches as engine_launches
from .fusion import OpFusion, fusion, unfused_penalty


class Plan(Protocol):
    """What the cost model (``plan_op_times``, ``simulate``) reads of a
    ``shardplan.solver.plan.Plan``: it sits below the solver, so it names the fields it needs
    instead of importing the solver."""

    graph: Graph
    mesh: Any
    shardings: Any
    operand_shardings: Any
    reshards: Any


_AT_PRODUCER = ("pin:", "reduce:")
"""Reshards done right at the producer (a user pin, a reduce-once pending sum): the op itself
writes their source layout."""


def plan_op_times(plan: Plan) -> list[float]:
    """Roofline seconds of each op under the plan's layouts (as ``solver.costs.op_cost``)."""
    cluster = cluster_of(plan.mesh)
    fused = fusion(plan.graph)
    produced = {r.value: r.src for r in plan.reshards if r.consumer.startswith(_AT_PRODUCER)}
    seen: dict[tuple, float] = {}  # the layers of a stack repeat the same op at the same layouts
    times = []
    for i, op in enumerate(plan.graph.ops):
        operands = tuple(plan.operand_shardings[(i, j)] for j in range(len(op.operands)))
        results = tuple(produced.get(r.name, plan.shardings[r.name]) for r in op.results)
        key = (op.kind, op.rule, operands, results, *(v.type for v in op.operands + op.results))
        key += (fused.of(op), op.attrs.get("causal"), op.attrs.get("load_balance"))
        if key not in seen:
            seen[key] = _op_time(op, operands, results, plan.mesh, cluster, fused.of(op))
        times.append(seen[key] * op.repeat)  # a scan body's op: every iteration
    by_name = {v.name: v for v in plan.graph.values()}
    for r in plan.reshards:  # a reshard inside a fused chain makes it go through HBM after all
        kind, _, rest = r.consumer.partition(":")
        i, _, j = rest.partition(":")
        if kind == "op" and (int(i), int(j)) in fused.edges:
            times[int(i)] += r.count * unfused_penalty(
                by_name[r.value].type, r.src, r.dst, plan.mesh, cluster
            )
    return times


def _op_time(op: Op, operands, results, mesh, cluster: Cluster, fused: OpFusion | None) -> float:  # type: ignore[no-untyped-def]
    """Local FLOPs are the global ones over the product of every mesh axis the op's layouts use
    (each axis splits one factor, so that product is the strategy's split). Operands and
    results a fused kernel keeps on chip (``costmodel.fusion``) move no HBM bytes."""
    axes = set().union(*(s.used_axes for s in operands + results))
    split = math.prod(mesh.axis_size(a) for a in axes)
    ins, outs = [v.type for v in op.operands], [v.type for v in op.results]
    flops = op_flops(op.kind, op.rule, ins, outs, op.attrs) / split
    flops *= attention_work_factor(op, operands, mesh, cluster)
    flops *= conv_work_factor(op, cluster)  # implicit-GEMM tiles (costmodel/conv.py)
    counts = [s.shard_count(mesh) for s in operands], [s.shard_count(mesh) for s in results]
    on_chip = (fused.on_chip_operands, fused.on_chip_results) if fused else ((), ())
    nbytes = op_bytes(op.kind, ins, outs, *counts, *on_chip, attrs=op.attrs, split=split)
    launches = engine_launches(op.kind, fused is None or fused.launches, cluster)
    halo = halo_time(op, operands, mesh, cluster)  # a spatially split convolution
    halo += layout_time(op, operands, results, mesh, cluster)  # NCHW <-> NHWC transposes
    return halo + compute_time(flops, nbytes, (outs or ins)[0].dtype, cluster, launches=launches)
