"""Elementwise fusion: which intermediates a fusing compiler keeps on chip instead of in HBM.

The roofline charges every op a read of its operands and a write of its results. A compiler
that fuses elementwise chains (XLA's loop and input fusion, torch.compile's Inductor, Megatron's
hand-fused kernels: ``FusedScaleMaskSoftmax``, fused bias-GeLU, RMSNorm, RoPE, SwiGLU) runs a
chain of pointwise ops as one kernel: the intermediate between two of them lives in registers,
so neither its write nor its read touches HBM, and only the kernel that writes to HBM pays a
launch. The rule here is deliberately the conservative core of what those compilers do:

- an **edge** ``producer -> consumer`` is fused when the producer's result has exactly one
  consuming op (following layout-only views, ``ir.VIEW_KINDS``) and is not a graph output, and
  both ops are fusible with at least one of them elementwise: elementwise after elementwise, an
  elementwise prologue into a row kernel (softmax, a norm), or an elementwise epilogue out of
  one. A value read by two ops (a forward value saved for backward, the q/k/v fan-out) is
  written: duplicating its producer into each reader is not modelled;
- the consumer must read the value whole (not broadcast it to a larger result), so the fused
  kernel reads each element once;
- a layout change on a fused edge (a reshard between producer and consumer) breaks it: the
  value is written and read after all. ``unfused_penalty`` prices that, and the solver adds it
  to the edge's reshard cost and the simulator to the consumer, so planner and simulator agree.

This is a property of the cost model, not an option: the planner prices the program its targets
run (XLA fuses always; torch.compile and Megatron fuse these chains). Eager PyTorch does not,
so for eager DTensor runs the elementwise part of the estimate is optimistic.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.ir import VIEW_KINDS, Graph, Op, Sharding, TensorType, Value
from shardplan.ir.mesh import Mesh
from shardplan.ir.registry import ELEMENTWISE, ELEMENTWISE_LINEAR

from .cluster import Cluster
from .per_graph import PerGraph

ELEMENTWISE_KINDS: frozenset[str] = frozenset(ELEMENTWISE + ELEMENTWISE_LINEAR) | {
    "constant",
    "iota",
}
"""Pointwise ops (and generators, which compute each element from its index)."""
ROW_KINDS: frozenset[str] = frozenset(
    """softmax log_softmax softmax_backward log_softmax_backward layer_norm rms_norm
    layer_norm_backward rms_norm_backward reduce_sum sum mean reduce_mean reduce_max
    reduce_min max_reduce amax amin""".split()
)
"""Kernels that stream their input once per row or reduction: they take an elementwise prologue
(Megatron's scale+mask into softmax, XLA's input fusion into a reduce) and an epilogue."""


@dataclass(frozen=True, slots=True)
class OpFusion:
    """Which of one op's operands are read on chip and which results are kept on chip."""

    on_chip_operands: tuple[bool, ...]
    on_chip_results: tuple[bool, ...]

    @property
    def launches(self) -> bool:
        """False when every result stays on chip: the op runs inside its consumer's kernel and
        pays no launch floor of its own."""
        return not all(self.on_chip_results)


@dataclass(frozen=True, slots=True)
class Fusion:
    """The fused edges of a graph (``fusion(graph)``).

    Invariants: every op in ``ops`` has at least one on-chip operand or result; ``edges`` holds
    ``(op index, operand index)`` of every edge of a fused chain, views included.
    """

    ops: dict[Op, OpFusion]
    edges: frozenset[tuple[int, int]]

    def of(self, op: Op) -> OpFusion | None:
        return self.ops.get(op)


def fusion(graph: Graph) -> Fusion:
    """The fused edges of ``graph`` (analysed once per graph, ``PerGraph``)."""
    return _FUSION(graph)


def _analyse(graph: Graph) -> Fusion:
    position = {op: i for i, op in enumerate(graph.ops)}
    outputs = {id(v) for v in graph.outputs}
    operands: dict[Op, list[bool]] = {}
    results: dict[Op, list[bool]] = {}
    edges: set[tuple[int, int]] = set()
    for op in graph.ops:
        if op.kind not in ELEMENTWISE_KINDS and op.kind not in ROW_KINDS:
            continue
        for k, value in enumerate(op.results):
            chain = _single_reader(value, outputs, position)
            if chain is None:
                continue
            reader, index = chain[-1]
            if not _fusible(op, reader, reader.operands[index], value):
                continue
            results.setdefault(op, [False] * len(op.results))[k] = True
            operands.setdefault(reader, [False] * len(reader.operands))[index] = True
            edges.update((position[user], j) for user, j in chain)
    ops = {
        op: OpFusion(
            tuple(operands.get(op, [False] * len(op.operands))),
            tuple(results.get(op, [False] * len(op.results))),
        )
        for op in {**operands, **results}
    }
    return Fusion(ops, frozenset(edges))


def _single_reader(
    value: Value, outputs: set[int], position: dict[Op, int]
) -> list[tuple[Op, int]] | None:
    """The uses from ``value`` through views to its one non-view reader, or None if it has
    several readers, none, or reaches a graph output."""
    chain: list[tuple[Op, int]] = []
    while True:
        if id(value) in outputs or len(value.uses) != 1:
            return None
        use = value.uses[0]
        chain.append((use.op, use.index))
        if use.op.kind not in VIEW_KINDS:
            return chain
        if len(use.op.results) != 1 or use.op not in position:
            return None
        value = use.op.results[0]


def _fusible(producer: Op, reader: Op, read: Value, value: Value) -> bool:
    """Both kinds fuse, one of them elementwise, and the reader reads the value whole."""
    kinds = (producer.kind, reader.kind)
    if not all(k in ELEMENTWISE_KINDS or k in ROW_KINDS for k in kinds):
        return False
    if not any(k in ELEMENTWISE_KINDS for k in kinds):
        return False
    largest = max((r.type.numel for r in reader.results), default=0)
    return read.type.numel == value.type.numel and largest <= value.type.numel


def unfused_penalty(
    type_: TensorType, src: Sharding, dst: Sharding, mesh: Mesh, cluster: Cluster
) -> float:
    """Seconds a reshard on a fused edge adds (0 when the layouts agree): the producer now ends
    its own kernel, writing ``type_`` in ``src`` (at least one kernel floor, which a fused op
    did not pay), and the consumer reads it in ``dst`` after all."""
    if src == dst:
        return 0.0
    bandwidth = cluster.hbm_bandwidth * cluster.memory_efficiency
    write = type_.nbytes / src.shard_count(mesh) / bandwidth
    return max(write, cluster.kernel_floor) + type_.nbytes / dst.shard_count(mesh) / bandwidth


_FUSION: PerGraph[Fusion] = PerGraph(_analyse)

__all__ = ["ELEMENTWISE_KINDS", "ROW_KINDS", "Fusion", "OpFusion", "fusion", "unfused_penalty"]
