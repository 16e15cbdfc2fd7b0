"""Hand-written parallelism strategies as pins the planner's cost model can evaluate.

A strategy fixes the layout of every graph input — parameters by role and module name
(q/k/v/gate/up/c_attn/c_fc/fc1 column-parallel, o/down/c_proj/fc2 row-parallel, embeddings
vocab-parallel), optimizer states like their parameter or sharded over the data axes, the
batch split over the data axes — plus a recomputation policy. The solver then fills in the
activation layouts inside (the cheapest ones consistent with the pins), so a baseline is at
least as good as its textbook version under the same cost model::

    ev = sp.evaluate(graph, mesh=mesh, strategy=sp.strategies.megatron(tp=8, recompute="full"))

ZeRO-1 and ZeRO-2 pin the same inputs: gradients are not inputs, and a reduce-scatter into a
sharded update is never slower than an all-reduce, so both evaluate as ZeRO-2.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..ir import Graph, Mesh, Role, Sharding, Value, op_info
from ..ir.checks import check_choice
from ..ir.errors import StrategyError

if TYPE_CHECKING:
    from .plan import Plan

# Names are separated by "." or "_" (torch FQNs) or by pytree brackets (JAX: params['wq']).
COLUMN = re.compile(
    r"(^|[._'\[])(q|k|v|wq|wk|wv|q_proj|k_proj|v_proj|gate|up|gate_proj|up_proj|c_attn|c_fc|fc1|w1|w3|query|key|value)([._#'\]]|$)"
)
ROW = re.compile(
    r"(^|[._'\[])(o|wo|o_proj|out_proj|down|down_proj|c_proj|fc2|w2|dense)([._#'\]]|$)"
)
VOCAB = re.compile(r"(embed|wte|tok_embeddings|lm_head|output\.weight)")


@dataclass(frozen=True, slots=True)
class ParallelStrategy:
    """One hand-written configuration (see the module docstring)."""

    name: str
    tp: str | None = None
    """Mesh axis for Megatron tensor parallelism."""
    dp: tuple[str, ...] | None = None
    """Data axes; None: every mesh axis other than ``tp``/``pp``."""
    shard_params: bool = False
    shard_states: bool = False
    sequence_parallel: bool = False
    recompute: str | None = None
    """None, ``"selective"`` or ``"full"`` for every layer."""
    pp: int = 1
    microbatches: int = 1
    cp: str | None = None
    """Mesh axis for context parallelism: the batch's sequence dim is split over it (attention
    then splits its queries and all-gathers K/V, ``ir.registry.attention_backward``);
    parameters are replicated over it like a data axis, and sharded over it with the data axes
    when sharded (torchtitan's FSDP mesh is ``dp_shard x cp``)."""
    tp_comm_overlap: bool = False
    """Tensor-parallel communication overlap (Megatron-Core ``--tp-comm-overlap``): the step
    simulator pipelines the ``tp`` axis's all-gathers and reduce-scatters with their GEMMs
    (``costmodel.simulate.SimulationOptions.tp_overlap_axes``)."""
    tp_size: int | None = None
    """The tensor-parallel degree the user asked for (``megatron(tp=8)``); the mesh must agree."""
    pipeline_axis: str = "pp"
    """Mesh axis the stages are laid along when ``pp > 1``."""
    chunks: int = 1
    """Model chunks per pipeline device (Megatron's virtual pipeline): > 1 is interleaved 1F1B."""
    ep: tuple[str, ...] | None = None
    """Expert parallelism: mesh axes the expert dim (dim 0 of 3-D ``experts`` weights) is split
    over. The batch stays split over the data axes, so when ``ep`` is (part of) them the tokens
    reach their experts by all-to-all (GShard); ``tp`` then splits each expert's hidden dim."""
    replicate: tuple[str, ...] = ()
    """Data axes sharded parameters stay replicated over (HSDP's replicate dim, torchtitan's
    ``data_parallel_replicate_degree``): they split the batch but shard nothing."""
    recompute_every: int = 1
    """Recompute only every n-th layer (torchtitan's ``selective_ac_option=n``: full
    recomputation of layers n, 2n, ... counted from 1); 1: every layer."""
    fsdp_dim0: bool = False
    """Sharded parameters split dim 0 over the shard axes, after (minor to) a TP split of
    that dim: FSDP2's layout (torchtitan), instead of the largest free dim."""
    schedule: str = "1f1b"
    """Pipeline schedule for ``pp > 1``: ``"1f1b"`` or ``"gpipe"`` (``chunks > 1`` is
    interleaved 1F1B)."""
    pp_gathered: bool = False
    """Under ``pp > 1``, sharded parameters stay gathered for the whole step and their
    gradients accumulate unsharded in fp32 until one reduction after the last backward
    (torchtitan: no reshard after forward under PP, no gradient sync between micro-batches);
    each stage's memory counts them (``plan_pipeline``'s ``gathered_axes``)."""

    def __post_init__(self) -> None:
        if isinstance(self.ep, (str, list)):
            object.__setattr__(
                self, "ep", (self.ep,) if isinstance(self.ep, str) else tuple(self.ep)
            )
        if isinstance(self.dp, str):
            object.__setattr__(self, "dp", (self.dp,))
        elif isinstance(self.dp, list):
            object.__setattr__(self, "dp", tuple(self.dp))
        if self.dp is not None and not (
            isinstance(self.dp, tuple) and all(isinstance(a, str) for a in self.dp)
        ):
            raise StrategyError(
                f"{self.name}: dp takes mesh axis names, e.g. dp=('dp',), not {self.dp!r}; "
                "the degree is the mesh's (sp.Mesh({'dp': 4, ...}))"
            )
        if self.tp is not None and not isinstance(self.tp, str):
            raise StrategyError(f"{self.name}: tp takes a mesh axis name, not {self.tp!r}")
        for field_name in ("pp", "microbatches", "chunks", "recompute_every"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StrategyError(
                    f"{self.name}: {field_name} must be a positive integer, not {value!r}"
                )

    def check(self, mesh: Mesh) -> None:
        """Raise a StrategyError naming the mismatch when the strategy does not fit ``mesh``."""
        if self.chunks > 1 and (self.pp == 1 or self.microbatches % self.pp):
            raise StrategyError(
                f"{self.name}: chunks={self.chunks} (interleaved 1F1B) needs pp > 1 and "
                f"micro-batches ({self.microbatches}) divisible by pp ({self.pp})"
            )
        sizes = dict(mesh.axes)
        named = [("tp", self.tp)] if self.tp is not None else []
        named += [("dp", a) for a in self.dp or ()]
        named += [("ep", a) for a in self.ep or () if a != DATA_AXES]
        for role, axis in named:
            if axis not in sizes:
                raise StrategyError(
                    f"{self.name}: {role} axis {axis!r} is not an axis of the mesh {mesh} "
                    f"(axes {list(mesh.axis_names)}); name one of them or add it to the mesh"
                )
        if self.tp is not None and self.tp_size is not None and sizes[self.tp] != self.tp_size:
            raise StrategyError(
                f"{self.name}: tp={self.tp_size} but the mesh's {self.tp!r} axis has size "
                f"{sizes[self.tp]}; build the mesh with {self.tp!r}: {self.tp_size} or pass "
                f"tp={self.tp!r} to take the mesh's size"
            )
        mesh_pp = sizes.get(self.pipeline_axis, 1)
        if self.pp != mesh_pp:
            raise StrategyError(
                f"{self.name}: pp={self.pp} but the mesh {mesh} has {self.pipeline_axis!r}="
                f"{mesh_pp}; the pipeline degree must be the mesh's {self.pipeline_axis!r} axis "
                f"(sp.Mesh({{{self.pipeline_axis!r}: {self.pp}, ...}}) or pp={mesh_pp})"
            )
        if self.tp == self.pipeline_axis or self.pipeline_axis in (self.dp or ()):
            raise StrategyError(
                f"{self.name}: the pipeline axis {self.pipeline_axis!r} cannot also be a "
                "tensor- or data-parallel axis"
            )

    def data_axes(self, mesh: Mesh) -> tuple[str, ...]:
        if self.dp is not None:
            return self.dp
        return tuple(a for a, n in mesh.axes if a not in (self.tp, self.cp, "pp") and n > 1)

    def expert_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """The axes expert weights split their expert dim over (mesh order); () without EP."""
        if not self.ep:
            return ()
        named = self.data_axes(mesh) if DATA_AXES in self.ep else self.ep
        return tuple(a for a in mesh.axis_names if a in named and mesh.axis_size(a) > 1)

    def shard_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """Axes sharded parameters and states are split over: the data axes, then ``cp``."""
        cp = (self.cp,) if self.cp and mesh.axis_size(self.cp) > 1 else ()
        return tuple(a for a in self.data_axes(mesh) if a not in self.replicate) + cp

    def finish(self, plan: Plan) -> Plan:
        """The plan solved under ``pins``, completed with what layouts cannot say (a table
        strategy's table-wise owners); the plan itself here."""
        return plan

    def pins(self, graph: Graph, mesh: Mesh) -> dict[str, Sharding]:
        """Value name -> layout for every graph input."""
        dp = self.data_axes(mesh)
        shard_axes = self.shard_axes(mesh)
        pins: dict[str, Sharding] = {}
        by_path = {v.origin.path: v for v in graph.inputs if v.role is Role.PARAMETER}
        for v in graph.inputs:
            if v.role is Role.PARAMETER:
                pins[v.name] = self._param(v, mesh, shard_axes, self.shard_params)
            elif v.role is Role.OPTIMIZER_STATE:
                param = by_path.get(v.origin.path.split("#")[0])
                shard = self.shard_params or self.shard_states
                pins[v.name] = (
                    self._param(param, mesh, shard_axes, shard)
                    if param is not None and param.type.shape == v.type.shape
                    else _split_largest(v, mesh, shard_axes if shard else ())
                )
            elif v.role is Role.INPUT and v.type.rank >= 1:
                pins[v.name] = self._batch(v, mesh, dp)
            elif v.role is Role.KV_CACHE:
                pins[v.name] = self._cache(v, mesh, dp)
        return pins

    def _cache(self, v: Value, mesh: Mesh, dp: tuple[str, ...]) -> Sharding:
        """A KV cache ``[batch, kv_heads, slot, head_dim]``: the batch over the data axes,
        the KV heads over ``tp`` (replicated over it when ``tp`` does not divide them, as
        serving engines do when ``tp > kv_heads``)."""
        layout = _on_dim(v, 0, dp, mesh)
        if self.tp and v.type.rank == 4 and v.type.shape[1] % mesh.axis_size(self.tp) == 0:
            return Sharding((layout.dims[0], (self.tp,), *layout.dims[2:]))
        return layout

    def _batch(self, v: Value, mesh: Mesh, dp: tuple[str, ...]) -> Sharding:
        """A batch input: its batch dim over the data axes, its sequence dim over ``cp``."""
        layout = _on_dim(v, 0, dp, mesh)
        if not self.cp or v.type.rank < 2 or mesh.axis_size(self.cp) == 1:
            return layout
        if v.type.shape[1] % mesh.axis_size(self.cp):
            raise StrategyError(
                f"{self.name}: input {v.name} has sequence length {v.type.shape[1]}, not a "
                f"multiple of the cp axis {self.cp!r} (size {mesh.axis_size(self.cp)})"
            )
        return Sharding((layout.dims[0], (self.cp,), *layout.dims[2:]))

    def _param(self, v: Value, mesh: Mesh, dp: tuple[str, ...], shard: bool) -> Sharding:
        dims: list[tuple[str, ...]] = [() for _ in v.type.shape]
        ep = self.expert_axes(mesh)
        tp_dim = self._tp_dim(v) if self.tp else None
        if is_expert_weight(v) and self.tp in ep:
            tp_dim = None  # EP folded over the tp axis: whole experts (Megatron's ETP = 1)
        if tp_dim is not None and v.type.shape[tp_dim] % mesh.axis_size(self.tp) == 0:
            dims[tp_dim] = (self.tp,)  # type: ignore[assignment]
        if ep and is_expert_weight(v) and v.type.shape[0] % mesh.group_size(ep) == 0:
            dims[0] = ep
            dp = tuple(a for a in dp if a not in ep)  # what is left to shard it over
        if shard and dp and self.fsdp_dim0 and v.type.rank:
            split = mesh.group_size(dims[0]) * mesh.group_size(dp)
            if v.type.shape[0] % split == 0:
                dims[0] = (*dims[0], *dp)
                return Sharding(tuple(dims))
        if shard and dp:
            size = mesh.group_size(dp)
            free = [d for d in range(v.type.rank) if not dims[d]]
            free.sort(key=lambda d: -v.type.shape[d])
            for d in free:
                if v.type.shape[d] % size == 0:
                    dims[d] = dp
                    break
        return Sharding(tuple(dims))

    def _tp_dim(self, v: Value) -> int | None:
        """Column: the weight's output dim; row: its contracted (input) dim; vocab: vocab dim."""
        path = v.origin.path
        if is_expert_weight(v):
            return _expert_tp_dim(v)
        if v.type.rank != 2:
            return None
        if VOCAB.search(path):
            return int(v.type.shape[1] > v.type.shape[0])  # the larger dim is the vocab
        out_dim = _output_dim(v)
        if out_dim is None:
            return None
        if ROW.search(path):
            return 1 - out_dim
        if COLUMN.search(path):
            return out_dim
        return None

    def recompute_decisions(self, graph: Graph) -> dict[str, str | None]:
        from ..passes.liveness import liveness

        layers = liveness(graph).layers
        if self.recompute_every == 1:
            return dict.fromkeys(layers, self.recompute)
        return {
            name: self.recompute if (i + 1) % self.recompute_every == 0 else None
            for i, name in enumerate(layers)
        }


def tensor_parallel_dim(v: Value) -> int | None:
    """The dim Megatron TP splits of a parameter (column: output features, row: input
    features, embedding/LM head: vocab), or None for a parameter TP leaves whole."""
    return ParallelStrategy("probe", tp="tp")._tp_dim(v)


def _output_dim(v: Value, skip: int | None = None) -> int | None:
    """Dim of a weight that passes through its first contraction into the result.

    The weight may reach the contraction through single-operand layout ops (``nn.Linear``
    lowers to a transpose then a matmul); the dim is followed through each one's factor rule,
    so a non-square weight (grouped-query k/v projections, MLP up/down) maps like a square one.
    """
    dim_of: list[int | None] = list(range(v.type.rank))  # original dim -> dim of the current value
    while True:
        users = [u for u in v.uses]
        if not users:
            return None
        use = users[0]
        rule = use.op.rule
        info = op_info(use.op.kind)
        dims = rule.operands[use.index]
        if info is not None and info.flops == "dot":
            result_factors = {f for dim in rule.results[0] for f in dim}
            for original, d in enumerate(dim_of):
                if original == skip:
                    continue
                if d is not None and any(f in result_factors for f in dims[d]):
                    return original
            return None
        if len(use.op.operands) != 1 or len(use.op.results) != 1:
            return None
        result = rule.results[0]
        dim_of = [None if d is None else _follow(dims[d], result) for d in dim_of]
        v = use.op.results[0]


DATA_AXES = "*"
"""``ParallelStrategy.ep`` entry meaning "the strategy's data axes"."""
EXPERTS = re.compile(r"(^|[._'\[])experts([._#'\]]|$)")


def is_expert_weight(v: Value) -> bool:
    """A stacked expert weight ``[experts, ...]`` (HF ``mlp.experts.gate_up_proj``)."""
    return v.type.rank == 3 and bool(EXPERTS.search(v.origin.path))


def _expert_tp_dim(v: Value) -> int | None:
    """Megatron TP inside each expert: up/gate split their output features, down its input
    features. Which stored dim that is comes from the weight's first batched matmul (the
    expert dim 0 passes through too; the other passing dim is the output one)."""
    out_dim = _output_dim(v, skip=0)
    if out_dim is None:
        return None
    if ROW.search(v.origin.path):
        return 3 - out_dim  # the other of dims 1 and 2
    return out_dim if COLUMN.search(v.origin.path) else None


def _follow(factors: tuple[str, ...], result: tuple[tuple[str, ...], ...]) -> int | None:
    """Result dim holding exactly ``factors`` (the same dim after a transpose or a cast)."""
    for d, dim in enumerate(result):
        if factors and dim == factors:
            return d
    return None


def _on_dim(v: Value, dim: int, axes: tuple[str, ...], mesh: Mesh) -> Sharding:
    dims: list[tuple[str, ...]] = [() for _ in v.type.shape]
    if axes and v.type.shape[dim] % mesh.group_size(axes) == 0:
        dims[dim] = axes
    return Sharding(tuple(dims))


def _split_largest(v: Value, mesh: Mesh, axes: tuple[str, ...]) -> Sharding:
    if not axes or v.type.rank == 0:
        return Sharding.replicated(v.type.rank)
    dim = max(range(v.type.rank), key=lambda d: v.type.shape[d])
    return _on_dim(v, dim, axes, mesh)


# -- the catalogue ------------------------------------------------------------------------------
def dp(recompute: str | None = None) -> ParallelStrategy:
    """Plain data parallel: everything replicated, batch split, gradients all-reduced."""
    return ParallelStrategy("dp" + _suffix(recompute), recompute=recompute)


def zero(stage: int, recompute: str | None = None) -> ParallelStrategy:
    """ZeRO-1/2 (optimizer states sharded over the data axes) or ZeRO-3 (= FSDP)."""
    if stage not in (1, 2, 3):
        raise StrategyError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
    return ParallelStrategy(
        f"zero{stage}" + _suffix(recompute),
        shard_states=True,
        shard_params=stage == 3,
        recompute=recompute,
    )


def fsdp(recompute: str | None = None) -> ParallelStrategy:
    """Fully sharded data parallel (ZeRO-3): parameters, gradients, states over the data axes."""
    return ParallelStrategy("fsdp" + _suffix(recompute), shard_params=True, recompute=recompute)


def megatron(
    tp: int | str = "tp",
    pp: int = 1,
    dp: tuple[str, ...] | None = None,
    sequence_parallel: bool = False,
    recompute: str | None = None,
    microbatches: int = 1,
    zero1: bool = False,
    tp_comm_overlap: bool = False,
    chunks: int = 1,
    cp: str | None = None,
) -> ParallelStrategy:
    """Megatron-LM: column/row tensor parallelism on the ``tp`` axis, data parallel elsewhere.

    ``cp`` names a context-parallel axis (Megatron-Core ``--context-parallel-size``, Llama 3's
    long-context runs): the sequence is split over it and attention all-gathers K/V.
    ``tp`` is the mesh axis name (an int means the axis called ``"tp"``; its size is the
    mesh's). ``zero1`` shards optimizer states over the data axes (Megatron's distributed
    optimizer). ``chunks`` > 1 runs interleaved 1F1B with that many model chunks per device.
    ``tp_comm_overlap`` (Megatron-Core ``--tp-comm-overlap``, Transformer Engine userbuffers;
    it needs ``sequence_parallel``) chunks each all-gather into a GEMM and each reduce-scatter
    out of one and pipelines the chunks with the GEMM: the step simulator exposes only
    ``max(0, comm - gemm)`` plus one chunk (``costmodel/simulate.py``).
    """
    if tp_comm_overlap and not sequence_parallel:
        raise StrategyError("tp_comm_overlap needs sequence_parallel (Megatron-Core requires it)")
    if recompute not in (None, "selective", "full"):
        raise StrategyError(f"recompute must be None, 'selective' or 'full', not {recompute!r}")
    if isinstance(tp, bool) or not isinstance(tp, (int, str)) or (isinstance(tp, int) and tp < 1):
        raise StrategyError(f"megatron: tp takes a mesh axis name or a degree, not {tp!r}")
    axis = tp if isinstance(tp, str) else "tp"
    name = f"megatron{'-sp' if sequence_parallel else ''}{'-zero1' if zero1 else ''}"
    name += "-tpoverlap" if tp_comm_overlap else ""
    name += f"-cp[{cp}]" if cp else ""
    if cp is not None and cp == axis:
        raise StrategyError(f"cp and tp must be different mesh axes, both are {cp!r}")
    return ParallelStrategy(
        name + _suffix(recompute),
        tp=axis,
        dp=dp,
        shard_states=zero1,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        pp=pp,
        microbatches=microbatches,
        tp_comm_overlap=tp_comm_overlap,
        tp_size=None if isinstance(tp, str) else tp,
        chunks=chunks,
        cp=cp,
    )


def tp_fsdp(
    tp: str = "tp",
    dp: tuple[str, ...] | None = None,
    recompute: str | None = None,
    cp: str | None = None,
) -> ParallelStrategy:
    """2-D: Megatron TP on ``tp`` and FSDP over the data axes (and ``cp``, the context axis)."""
    name = "tp-fsdp" + (f"-cp[{cp}]" if cp else "") + _suffix(recompute)
    return ParallelStrategy(name, tp=tp, dp=dp, shard_params=True, recompute=recompute, cp=cp)


def torchtitan(
    dp_replicate: int = 1,
    dp_shard: int = 1,
    cp: int = 1,
    tp: int = 1,
    pp: int = 1,
    ac_mode: str = "none",
    selective_ac_option: str = "op",
    schedule: str = "1f1b",
    microbatches: int = 1,
    name: str | None = None,
) -> ParallelStrategy:
    """torchtitan's ``parallelize_llama`` plan on the mesh it builds (axes ``pp, dp_replicate,
    dp_shard, cp, tp``, size-1 ones left out; ``TitanConfig.mesh()``): Megatron TP with
    sequence parallelism on ``tp``, FSDP2 (dim 0) over ``dp_shard x cp``, HSDP replicas over
    ``dp_replicate``, and one activation-checkpoint mode (``selective_ac_option`` "op", or n:
    full recomputation of every n-th layer). ``titan_config.TitanConfig`` reads and writes the
    command-line overrides of the same configuration."""
    if ac_mode not in ("none", "selective", "full"):
        raise StrategyError(f"torchtitan ac_mode {ac_mode!r}: 'none', 'selective' or 'full'")
    data = tuple(a for a, n in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)) if n > 1)
    recompute = None if ac_mode == "none" else ac_mode
    every = 1
    if ac_mode == "selective" and selective_ac_option != "op":
        recompute, every = "full", int(selective_ac_option)
    fsdp = dp_shard * cp > 1
    return ParallelStrategy(
        name or f"torchtitan[r{dp_replicate} s{dp_shard} cp{cp} tp{tp} pp{pp} ac={ac_mode}]",
        tp="tp" if tp > 1 else None,
        dp=data,
        shard_params=fsdp,
        sequence_parallel=tp > 1,
        recompute=recompute,
        recompute_every=every,
        pp=pp,
        microbatches=microbatches if pp > 1 else 1,
        cp="cp" if cp > 1 else None,
        chunks=2 if pp > 1 and schedule == "interleaved" else 1,
        schedule=schedule if schedule != "interleaved" else "1f1b",
        replicate=("dp_replicate",) if fsdp and dp_replicate > 1 else (),
        fsdp_dim0=True,
        tp_size=tp if tp > 1 else None,
        pp_gathered=fsdp and pp > 1,
    )


def expert_parallel(
    ep: str | tuple[str, ...] | None = None,
    tp: str | None = None,
    shard_states: bool = False,
    shard_params: bool = False,
    recompute: str | None = None,
) -> ParallelStrategy:
    """Mixture-of-experts: the expert dim over ``ep`` (default: every data axis, GShard's
    EP over the data axis), tokens split over the data axes and moved by all-to-all. With
    ``tp``, Megatron TP on that axis for attention and inside each expert (EP x TP); with
    ``tp`` among ``ep`` too, the experts are split over it whole instead (Megatron-Core's
    parallel folding, expert TP 1).
    ``shard_states`` / ``shard_params``: ZeRO-1 / FSDP over the data axes the experts are not
    already split over (and the full data axes for the dense weights)."""
    dense = ParallelStrategy("probe", tp=tp)
    ep_axes = (ep,) if isinstance(ep, str) else ep
    name = f"ep[{','.join(ep_axes) if ep_axes else 'data'}]" + (f"-tp[{tp}]" if tp else "")
    name += "-fsdp" if shard_params else "-zero1" if shard_states else ""
    return ParallelStrategy(
        name + _suffix(recompute),
        tp=dense.tp,
        ep=ep_axes or (DATA_AXES,),
        shard_states=shard_states,
        shard_params=shard_params,
        recompute=recompute,
    )


def moe_baselines(mesh: Mesh) -> list[ParallelStrategy]:
    """Expert-parallel baselines that fit the mesh: EP over the data axes (with ZeRO-1 and
    FSDP), and EP x TP when the mesh has a ``tp`` axis."""
    out = []
    has_tp = "tp" in mesh.axis_names and mesh.axis_size("tp") > 1
    has_ep = "ep" in mesh.axis_names and mesh.axis_size("ep") > 1
    for recompute in (None, "full"):
        for kw in ({}, {"shard_states": True}, {"shard_params": True}):
            out.append(expert_parallel(recompute=recompute, **kw))
            if has_ep:
                out.append(expert_parallel("ep", recompute=recompute, **kw))
            if has_tp:
                out.append(expert_parallel(tp="tp", recompute=recompute, **kw))
            if has_tp and has_ep:
                out.append(expert_parallel("ep", tp="tp", recompute=recompute, **kw))
    return out


EXPERT_OPS = frozenset({"moe_dispatch"})
"""Op kinds that make a graph a mixture of experts (its baselines then include EP ones)."""


def for_graph(graph: Graph, mesh: Mesh) -> list[ParallelStrategy]:
    """The hand-written strategies ``sp.plan`` must not be slower than on ``graph``: every
    dense baseline, and for a mixture of experts the expert-parallel ones too."""
    moe = any(op.kind in EXPERT_OPS for op in graph.ops)
    return baselines(mesh) + (moe_baselines(mesh) if moe else [])


RECOMPUTE = (None, "selective", "full")
"""The recompute (activation checkpointing) policies a hand-written strategy may name."""


def _suffix(recompute: str | None) -> str:
    check_choice(recompute, "recompute", RECOMPUTE)  # every constructor names itself through here
    return f"+{recompute}-recompute" if recompute else ""


def serving(mesh: Mesh, pp: str = "pp") -> list[ParallelStrategy]:
    """The usual serving layouts for a prefill/decode plan on ``mesh``: replicated data
    parallel (every device a whole model, the batch split), TP-only (Megatron over ``tp``,
    KV heads split) and, with a ``pp`` axis, TP x PP (a pipelined mesh has no replicated
    DP baseline). Price them with ``sp.evaluate``."""
    stages = mesh.axis_size(pp) if pp in mesh.axis_names else 1
    out = [dp()] if stages == 1 else []
    if "tp" in mesh.axis_names and mesh.axis_size("tp") > 1:
        out.append(megatron("tp", pp=stages) if stages > 1 else megatron("tp"))
    return out


def baselines(mesh: Mesh) -> list[ParallelStrategy]:
    """Every hand-written strategy that fits the mesh's axes, with and without recompute."""
    out = []
    has_tp = "tp" in mesh.axis_names and mesh.axis_size("tp") > 1
    for recompute in (None, "selective", "full"):
        out += [dp(recompute), zero(1, recompute), fsdp(recompute)]
        if has_tp:
            out += [megatron("tp", recompute=recompute), tp_fsdp("tp", recompute=recompute)]
    return out


def embedding(*args: object, **kwargs: object) -> ParallelStrategy:
    """Embedding tables laid out by hand (row-wise, column-wise, data-parallel) over a dense
    base strategy: ``table_strategies.embedding`` (its module docstring has the details)."""
    from .table_strategies import embedding as build

    return build(*args, **kwargs)  # type: ignore[arg-type]
