"""Rank torchtitan's configuration space for one captured training step (capture once, price many).

``search_torchtitan(graph, world_size)`` enumerates every ``TitanConfig`` torchtitan accepts
for the graph's model and batch (degrees x pipeline schedule x micro-batches x activation
checkpoint mode) and prices each in closed form from one profile of the graph
(``StepProfile``: per-layer single-device compute of forward, backward and recomputation from
the roofline, per-layer parameter and saved-activation bytes) with the cost model's own
collective prices (``collective_time`` on the configuration's mesh: FSDP gathers and
reduce-scatters hidden under the layer's compute where they fit, tensor- and context-parallel
collectives exposed, torchtitan having no async TP by default) and pipelines as torchtitan
runs them (``_pipeline_seconds``, ``_pipelined_fsdp``, ``_gathered_bytes``). No configuration
is solved: a full 8B-on-64 space prices in about a second. ``exact=k`` re-prices the best
``k`` with ``sp.evaluate`` (the pinned solve the rest of the project compares with), which is
what ``to_torchtitan`` reports.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..costmodel import cluster_of, collective_time, get_cluster, group_link
from ..costmodel.compute import compute_time
from ..ir import Graph, Role, op_bytes, op_flops
from ..ir.errors import InfeasiblePlanError
from ..passes.liveness import Phase, liveness
from ..passes.repeated_layers import layer_key
from .titan_config import SCHEDULES, TitanConfig

MEMORY_HEADROOM = 0.10
"""Fraction of the memory limit the closed form keeps free: its memory is coarse (Llama-3-8B on
64 devices without AC: 73.2 and 69.7 GiB closed form where ``sp.evaluate``'s solve needed the
whole 74.5 GiB and traded layouts for it, 20-30% slower; 59.0 vs 60.3 GiB with selective AC),
so a configuration that only just fits is not ranked first on a price it cannot get."""
AC_CHOICES = (("none", "op"), ("selective", "op"), ("selective", "2"), ("full", "op"))


@dataclass
class StepProfile:
    """What the closed form needs from one captured step (single-device seconds and bytes).

    ``groups`` holds, per part of the step (a layer's ``forward``, ``backward``, ``recompute-
    selective``/``recompute-full`` ops, and ``other``: embedding, loss, update), each op's
    roofline seconds on one device and whether it launches a kernel of its own (fused ops pay
    no floor, as in the step simulator); ``seconds(part, n)`` is the part split ``n`` ways,
    each kernel at least the cluster's launch floor."""

    layers: int
    groups: dict[str, tuple[np.ndarray, np.ndarray]]
    floor: float
    layer_params: int
    """Parameters per layer (elements)."""
    params: int
    saved: dict[str, int]
    """AC mode (``none``, ``selective``, ``full``) -> activation bytes one layer keeps."""
    other_saved: int
    """Activation bytes outside the layers kept for backward (the logits)."""
    batch: int
    seq_len: int
    hidden: int
    kv_hidden: int
    activation_bytes: int
    """Bytes per activation element."""
    _cache: dict[tuple[str, float], float] = field(default_factory=dict)

    def seconds(self, part: str, n: float) -> float:
        key = (part, n)
        if key not in self._cache:
            roofline, launches = self.groups.get(part, (np.zeros(0), np.zeros(0)))
            self._cache[key] = float(np.maximum(roofline / n, launches * self.floor).sum())
        return self._cache[key]


def profile(graph: Graph, cluster: str = "h100-sxm") -> StepProfile:
    """One pass over the graph (class docstring)."""
    from ..costmodel.fusion import fusion

    live = liveness(graph)
    layer_of = {i: name for name, lay in live.layers.items() for i in lay.forward_ops}
    first = next(iter(live.layers.values()))
    fused = fusion(graph)
    times = [_op_time(op, cluster, fused.of(op)) for op in graph.ops]
    parts = {
        "forward": list(first.forward_ops),
        "backward": _layer_backward(graph, first.name, live.phase),
    }
    for mode, ops in first.recompute_ops.items():
        parts["recompute-" + mode] = list(ops)
    in_layers = set(layer_of) | set(_layer_backward(graph, "", live.phase, layers=True))
    parts["other"] = [i for i in range(len(graph.ops)) if i not in in_layers]
    parts.update(_ends(graph, parts["other"], min(in_layers), max(in_layers)))
    groups = {
        name: (np.array([times[i][0] for i in ops]), np.array([times[i][1] for i in ops]))
        for name, ops in parts.items()
    }
    params = [v for v in graph.inputs if v.role is Role.PARAMETER]
    layer_params = sum(v.type.numel for v in params if v.origin.path.startswith(first.name + "."))
    saved_full = sum(v.type.nbytes for v in first.saved.get("full", ()))
    saved_sel = sum(v.type.nbytes for v in first.saved.get("selective", ()))
    tokens = next(v for v in graph.inputs if v.role is Role.INPUT and v.type.rank == 2)
    hidden = max(v.type.shape[1] for v in params if v.type.rank == 2)
    wk = [v for v in params if v.origin.path.endswith("attention.wk.weight")]
    return StepProfile(
        layers=len(live.layers),
        groups=groups,
        floor=get_cluster(cluster).kernel_floor,
        layer_params=layer_params,
        params=sum(v.type.numel for v in params),
        saved={"none": saved_full, "selective": saved_full - saved_sel, "full": 0},
        other_saved=_other_saved(graph, live, layer_of),
        batch=tokens.type.shape[0],
        seq_len=tokens.type.shape[1],
        hidden=hidden,
        kv_hidden=wk[0].type.shape[0] if wk else hidden,
        activation_bytes=params[0].type.itemsize,
    )


def _ends(graph: Graph, other: list[int], first: int, last: int) -> dict[str, list[int]]:
    """The ops outside the layers by where a pipeline runs them: ``pre`` (the embedding, its
    forward before the stack and its gradient after it) on the first stage, ``post`` (final
    norm, output, loss and their backward) on the last stage, ``update`` (the optimizer) on
    every stage for its own parameters (``solver/pipeline.py``'s ``_time_split``)."""
    parts: dict[str, list[int]] = {"pre": [], "post": [], "update": []}
    for i in other:
        if graph.ops[i].origin.module == "optimizer":
            parts["update"].append(i)
        else:
            parts["pre" if i < first or i > last else "post"].append(i)
    return parts


def _op_time(op, cluster: str, fused) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(roofline seconds on one device, 1.0 if the op launches a kernel of its own)."""
    ins = [v.type for v in op.operands]
    outs = [v.type for v in op.results]
    flops = op_flops(op.kind, op.rule, ins, outs, op.attrs)
    chips = (fused.on_chip_operands, fused.on_chip_results) if fused else ((), ())
    nbytes = op_bytes(op.kind, ins, outs, [1] * len(ins), [1] * len(outs), *chips)
    dtype = outs[0].dtype if outs else "f32"
    seconds = compute_time(flops, nbytes, dtype, cluster, launches=False)
    launches = seconds > 0 and (fused is None or fused.launches)
    return seconds, float(launches)


def _layer_backward(graph: Graph, name: str, phase, layers: bool = False) -> list[int]:  # type: ignore[no-untyped-def]
    """Backward ops of layer ``name`` (of every layer with ``layers``)."""
    prefix = name + "."
    return [
        i for i, op in enumerate(graph.ops)
        if phase[i] is Phase.BACKWARD
        and (layer_key(op.origin.module) is not None if layers
             else (op.origin.module + ".").startswith(prefix))
    ]  # fmt: skip


def _other_saved(graph: Graph, live, layer_of: dict[int, str]) -> int:  # type: ignore[no-untyped-def]
    total = 0
    for v, start in live.define.items():
        if v.producer is None or start in layer_of or live.phase[start] is not Phase.FORWARD:
            continue
        end = live.last_use[v]
        if end < len(live.phase) and live.phase[end] is Phase.BACKWARD:
            total += v.type.nbytes
    return total


@dataclass(frozen=True, slots=True)
class Priced:
    """One configuration's modelled step and per-device memory (closed form)."""

    config: TitanConfig
    step_time: float
    memory_bytes: float
    fits: bool
    parts: dict[str, float] = field(default_factory=dict)


def price(prof: StepProfile, config: TitanConfig, cluster: str, limit: float) -> Priced:
    """The closed-form step of ``config`` (module docstring); see ``docs/torchtitan.md``."""
    mesh = config.mesh(cluster)
    n = config.data_parallel * config.cp * config.tp
    forward_l = prof.seconds("forward", n)
    backward_l = prof.seconds("backward", n) + _recompute_seconds(prof, config, n)
    tp_f, tp_b = _tp_seconds(prof, config, mesh, cluster)
    cp_f, cp_b = _cp_seconds(prof, config, mesh, cluster)
    ag, rs, ar = _fsdp_seconds(prof, config, mesh, cluster)
    layers = prof.layers // config.pp
    f = layers * (forward_l + tp_f + cp_f)
    b = layers * (backward_l + tp_b + cp_b)
    if config.pp > 1:
        body = _pipeline_seconds(prof, config, f + b, n, _p2p_seconds(prof, config, mesh))
        exposed = _pipelined_fsdp(config, layers, forward_l, backward_l, (ag, rs, ar))
        other = prof.seconds("update", n * config.pp)
    else:
        body = f + b
        # FSDP prefetch hides a layer's gather under the previous layer's compute (and the
        # gradient reduce-scatter under the next one's backward): only the excess is exposed.
        exposed = layers * (max(0.0, ag - forward_l) + max(0.0, ag + rs - backward_l) + ar)
        other = prof.seconds("other", n)
    step = body + exposed + other
    memory = _memory(prof, config)
    limit *= 1 - MEMORY_HEADROOM
    parts = {"compute_and_tp": body, "fsdp_exposed": exposed, "other": other}
    return Priced(config, step, memory, memory <= limit, parts)


def _pipeline_seconds(
    prof: StepProfile, config: TitanConfig, work: float, n: int, p2p: float
) -> float:
    """One step of torchtitan's pipeline on equal stages of ``work`` seconds (the whole local
    batch's forward + backward of a stage's layers), the first stage also running the
    embedding and the last the output and loss, every micro-batch (``pre`` / ``post``): the
    stage formula ``sp.evaluate``'s pipelines use (``solver/stages.py``'s ``evaluate_split``),
    ``(sum_s t_s / v + (m - 1/v) max_s t_s) / m`` plus ``2 (p v - 1)`` hand-offs of fill and
    drain (the steady state's sends are asynchronous, as torchtitan's schedules post them).
    For equal ``t_s`` this is the SC'21 bubble ``(m + (p - 1) / v) t / m``; a heavier end
    stage paces every micro-batch (Llama-3-70B at pp 4 on 64-device stages: the 128K-vocab
    output and loss are 6% of a 20-layer stage's work, which the old closed form divided by
    ``pp`` as if every stage shared it)."""
    p, m, v = config.pp, config.microbatches, config.stages_per_rank
    pre, post = prof.seconds("pre", n), prof.seconds("post", n)
    times = [work + (pre if s == 0 else 0.0) + (post if s == p - 1 else 0.0) for s in range(p)]
    return (sum(times) / v + (m - 1 / v) * max(times)) / m + 2 * (p * v - 1) * p2p


def _pipelined_fsdp(
    config: TitanConfig, layers: int, forward_l: float, backward_l: float, comms: tuple
) -> float:
    """Exposed FSDP seconds of one pipeline stage as torchtitan runs it (``docs/torchtitan.md``,
    "Pipelines"): the stage's parameters stay gathered for the whole step (torchtitan's
    ``reshard_after_forward`` is off under PP, and ``torch.distributed.pipelining`` turns
    ``reshard_after_backward`` and gradient sync off for every micro-batch), so each layer is
    gathered once, in the first micro-batch's forward, hidden only under that micro-batch's
    compute of the layer before (``forward_l / m``); the gradients are reduce-scattered (and
    all-reduced over ``dp_replicate``) once, after the stage's last backward (the schedule's
    ``REDUCE_GRAD`` action), with nothing left to hide them under on the first stage, which
    ends the step. Under Interleaved1F1B each chunk reduces after its own last backward: all
    but the last chunk's reductions overlap the drain of the last one (``min(p, m)`` of its
    micro-batch backwards)."""
    ag, rs, ar = comms
    m, v = config.microbatches, config.stages_per_rank
    gather = layers * max(0.0, ag - forward_l / m)
    reduce = layers * (rs + ar)
    if v > 1:
        last = reduce / v
        drain = min(config.pp, m) * backward_l * (layers / v) / m
        reduce = last + max(0.0, reduce - last - drain)
    return gather + reduce


def _recompute_seconds(prof: StepProfile, config: TitanConfig, n: int) -> float:
    if config.ac_mode == "none":
        return 0.0
    if config.ac_mode == "selective" and config.selective_ac_option != "op":
        return prof.seconds("recompute-full", n) / int(config.selective_ac_option)
    return prof.seconds("recompute-" + config.ac_mode, n)


def _local_tokens(prof: StepProfile, config: TitanConfig) -> float:
    return prof.batch / config.data_parallel * prof.seq_len / config.cp


def _tp_seconds(prof, config, mesh, cluster) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Sequence-parallel TP: per layer two all-gathers and two reduce-scatters of the
    ``[tokens, hidden]`` activation in forward, the mirror four in backward (plus the forward's
    again when the layer is recomputed in full)."""
    if config.tp == 1:
        return 0.0, 0.0
    full = _local_tokens(prof, config) * prof.hidden * prof.activation_bytes
    one = collective_time("all-gather", full, "tp", mesh, cluster)
    one += collective_time("reduce-scatter", full / config.tp, "tp", mesh, cluster)
    again = 2 * one if config.ac_mode == "full" else 0.0
    return 2 * one, 2 * one + again


def _cp_seconds(prof, config, mesh, cluster) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """All-gather CP: K and V gathered over ``cp`` in forward, again in backward, and their
    gradients reduce-scattered."""
    if config.cp == 1:
        return 0.0, 0.0
    tokens = prof.batch / config.data_parallel * prof.seq_len
    kv = 2 * tokens * prof.kv_hidden / config.tp * prof.activation_bytes
    gather = collective_time("all-gather", kv, "cp", mesh, cluster)
    scatter = collective_time("reduce-scatter", kv / config.cp, "cp", mesh, cluster)
    return gather, gather + scatter


def _fsdp_seconds(prof, config, mesh, cluster) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """Per layer: the parameter all-gather (mixed-precision dtype) and the fp32 gradient
    reduce-scatter over ``dp_shard x cp``; the HSDP/DDP all-reduce over ``dp_replicate``."""
    per_tp = prof.layer_params / config.tp
    param_bytes = 2 if config.mixed_precision_param == "bfloat16" else 4
    shard = tuple(a for a in ("dp_shard", "cp") if config.degrees()[a] > 1)
    ag = rs = ar = 0.0
    if shard:
        ag = collective_time("all-gather", per_tp * param_bytes, shard, mesh, cluster)
        size = mesh.group_size(shard)
        rs = collective_time("reduce-scatter", per_tp * 4 / size, shard, mesh, cluster)
        per_tp /= size
    if config.dp_replicate > 1:
        ar = collective_time("all-reduce", per_tp * 4, "dp_replicate", mesh, cluster)
    return ag, rs, ar


def _p2p_seconds(prof, config, mesh) -> float:  # type: ignore[no-untyped-def]
    """One micro-batch's hand-off to the next stage: the residual stream, split over ``tp``
    by sequence parallelism, on the ``pp`` axis's link (``plan_pipeline``'s hand-off)."""
    tokens = _local_tokens(prof, config) / config.microbatches / config.tp
    link = group_link(("pp",), mesh, cluster_of(mesh))
    return link.latency + tokens * prof.hidden * prof.activation_bytes / link.p2p_bandwidth


def _memory(prof: StepProfile, config: TitanConfig) -> float:
    """Per device: fp32 parameters, gradients and AdamW moments (16 bytes each) sharded over
    every axis that shards them, the gathered parameters (``_gathered_bytes``), and the saved
    activations of the layers (of the micro-batches in flight under a pipeline)."""
    sharded = config.tp * config.pp * (config.dp_shard * config.cp)
    state = 16 * prof.params / sharded
    gathered = _gathered_bytes(prof, config)
    mode = config.ac_mode
    per_layer = prof.saved["full" if mode == "full" else mode]
    if mode == "selective" and config.selective_ac_option != "op":
        every = int(config.selective_ac_option)
        per_layer = prof.saved["none"] * (every - 1) / every
    boundary = (
        _local_tokens(prof, config) * prof.hidden * prof.activation_bytes * config.data_parallel
    )
    split = config.data_parallel * config.cp * config.tp
    layers = prof.layers / config.pp
    acts = layers * (per_layer + boundary) / split
    if config.pp > 1:
        in_flight = config.microbatches if config.pipeline_schedule == "GPipe" else config.pp
        acts *= min(in_flight, config.microbatches) / config.microbatches
    return state + gathered + acts + prof.other_saved / split


def _gathered_bytes(prof: StepProfile, config: TitanConfig) -> float:
    """FSDP's unsharded parameters: two layers at a time (the one computing and the one
    prefetched), except under a pipeline, where torchtitan keeps the stage's parameters
    gathered for the step (``_pipelined_fsdp``) and accumulates their gradients unsharded in
    fp32 (FSDP2's ``reduce_dtype``) until the one reduction: ``param + 4`` bytes per parameter
    of the fullest stage (its layers and one of embedding / output)."""
    param_bytes = 2 if config.mixed_precision_param == "bfloat16" else 4
    if config.pp == 1 or config.dp_shard * config.cp == 1:
        return 2 * prof.layer_params / config.tp * param_bytes
    ends = prof.params - prof.layers * prof.layer_params  # embedding and output, one per end
    stage = prof.layers / config.pp * prof.layer_params + ends / 2
    return stage / config.tp * (param_bytes + 4)


# -- the space ----------------------------------------------------------------------------------
@dataclass
class TitanSearch:
    """Every configuration priced, best first; ``free`` is the free plan's step (the bound)."""

    ranked: list[Priced]
    rejected: int
    seconds: float
    free_step: float | None = None
    exact: dict[str, float] = field(default_factory=dict)
    """Label -> ``sp.evaluate``'s step for the re-priced best configurations."""

    @property
    def best(self) -> Priced:
        fitting = [p for p in self.ranked if p.fits]
        if not fitting:
            raise InfeasiblePlanError("no torchtitan configuration fits the memory limit")
        return fitting[0]

    def table(self, top: int = 10) -> str:
        lines = [f"{'configuration':44} {'step ms':>9} {'GiB/dev':>8} fits"]
        for p in self.ranked[:top]:
            exact = self.exact.get(p.config.label())
            tail = f"  (evaluate {exact * 1e3:.1f} ms)" if exact else ""
            lines.append(
                f"{p.config.label():44} {p.step_time * 1e3:9.1f} {p.memory_bytes / 2**30:8.1f}"
                f" {'yes' if p.fits else 'no'}{tail}"
            )
        if self.free_step is not None:
            lines.append(f"free plan (bound): {self.free_step * 1e3:.1f} ms")
        return "\n".join(lines)


def configurations(
    prof: StepProfile,
    world: int,
    n_heads: int,
    n_kv_heads: int,
    devices_per_node: int = 8,
    flavor: str | None = None,
) -> list[TitanConfig]:
    """Every configuration torchtitan accepts for this model and global batch on ``world``."""
    out = []
    for tp, cp, pp, rep in itertools.product(*[_divisors(world)] * 4):
        if tp > devices_per_node or world % (tp * cp * pp * rep):
            continue
        shard = world // (tp * cp * pp * rep)
        dp = rep * shard
        if prof.batch % dp:
            continue
        base = TitanConfig(rep, shard, cp, tp, pp, prof.batch // dp, prof.seq_len, flavor=flavor)
        for config in _variants(base):
            if not config.problems(world, prof.layers, n_heads, n_kv_heads):
                out.append(config)
    return out


def _variants(base: TitanConfig):  # type: ignore[no-untyped-def]
    for mode, option in AC_CHOICES:
        config = base.replace(ac_mode=mode, selective_ac_option=option)
        if base.pp == 1:
            yield config
            continue
        for schedule in SCHEDULES:
            for size in _divisors(base.local_batch_size):
                yield config.replace(pipeline_schedule=schedule, microbatch_size=size)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_torchtitan(
    graph: Graph,
    world_size: int,
    n_heads: int,
    n_kv_heads: int,
    cluster: str = "h100-sxm",
    memory_limit: float | None = None,
    flavor: str | None = None,
) -> TitanSearch:
    """Rank every torchtitan configuration for ``graph`` on ``world_size`` devices (module
    docstring); fitting ones first, each group by modelled step."""
    start = time.perf_counter()
    limit = memory_limit if memory_limit is not None else get_cluster(cluster).hbm_capacity
    prof = profile(graph, cluster)
    per_node = get_cluster(cluster).devices_per_node
    configs = configurations(prof, world_size, n_heads, n_kv_heads, per_node, flavor)
    priced = [price(prof, c, cluster, limit) for c in configs]
    priced.sort(key=lambda p: (not p.fits, p.step_time, p.config.label()))
    rejected = _space_size(world_size, prof) - len(configs)
    return TitanSearch(priced, max(rejected, 0), time.perf_counter() - start)


def _space_size(world: int, prof: StepProfile) -> int:
    return sum(
        1 for t, c, p, r in itertools.product(*[_divisors(world)] * 4)
        if world % (t * c * p * r) == 0
    ) * len(AC_CHOICES)  # fmt: skip


def best_cost(search: TitanSearch) -> float:
    return search.best.step_time if search.ranked else math.inf
