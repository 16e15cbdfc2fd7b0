"""A learned performance predictor that ranks mesh shapes before they are planned (CubicML).

Mesh search (``solver/mesh_search.py``) plans every (pp, [dcn,] dp, tp) shape in full: an
intra-op ILP per shape, and a stage assignment when ``pp > 1``. Most of that time goes to shapes
that lose. The predictor is a small gradient-boosted regression (scikit-learn) from cheap
*configuration features* to the planner's own modelled step time; the search plans only the
``top_k`` shapes it ranks best (``sp.plan(..., devices=N, mesh_top_k=3)``).

Features (``shape_features``) are closed forms computed from the graph once (global FLOPs,
parameter / optimizer-state / activation bytes, layers) and, per shape, from the cost model's
own collective prices. They are role-free: the planner gives any axis any role, so they price
the best split of the non-pipeline axes into data and tensor roles, not the roles the axis
names suggest (docs/design.md, "Mesh search ranked by a learned predictor"). The target is
``log(step_time / ideal compute)``: dimensionless, so one model serves models of any size; a
shape the planner rejects (out of memory, a pipeline deeper than the model) is learned as
``REJECTED``. Accuracy is measured on held-out model families and clusters
(``cross_validate``).

The model file (``data/predictor/model.json``) is versioned and plain JSON: the training rows
(features and targets, made by ``bench/predictor.py --build`` from full mesh searches), the
feature names and the hyper-parameters. Loading refits the regression from those rows, which
is deterministic (fixed seed) and takes about 3 s of CPU, so no pickle ties the file to one
scikit-learn build; ``tests/test_predictor.py`` rebuilds some rows with the planner and checks
they equal the committed ones.

scikit-learn is an optional dependency (``pip install shardplan[predictor]``); it is imported
only when a predictor is fitted, so ``import shardplan`` and the planner work without it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..costmodel import axis_links, collective_time, get_cluster
from ..costmodel.cluster import Cluster
from ..ir import Graph, Mesh, ShardplanError
from ..ir.errors import PredictorError
from ..ir.graph import Role
from ..ir.op_cost import op_flops

FORMAT = 2
"""Version of the model file; a file of another version is refused (rebuild it). 2: the
role-free features (``shape_features``)."""
MODEL_FILE = Path(__file__).resolve().parent.parent / "data" / "predictor" / "model.json"
REJECTED = 6.0
"""Target of a shape the planner rejects: e^6 ~ 400x the ideal compute time, worse than any
planned shape in the training set, so rejected shapes rank last."""
MAX_MICROBATCHES = 64
"""The pipeline planner's bound on micro-batches (``solver/pipeline.py``), for the bubble."""
FEATURES = (
    "log_pp", "log_devices", "log_compute", "log_comm", "sync", "tp_comm", "log_mem",
    "over_memory", "log_layers_per_stage", "log_tokens_per_device", "axes", "axes_inter_node",
    "axes_inter_island", "log_data", "log_tensor", "bubble", "log_comm_bubble",
    "log_microbatches", "head_share", "stage_load",
)  # fmt: skip
PARAMS = dict(n_estimators=100, max_depth=4, learning_rate=0.15, subsample=1.0, random_state=0)


@dataclass(frozen=True, slots=True)
class GraphSummary:
    """What the features need from a graph, computed once per graph (one pass over its ops)."""

    flops: float
    """Global FLOPs of one step (ops times their ``repeat``)."""
    param_bytes: float
    state_bytes: float
    """Optimizer-state bytes (AdamW moments)."""
    activation_bytes: float
    """Bytes of every op result (times ``repeat``): what a step writes, an upper bound on what
    it keeps live."""
    dot_bytes: float
    """Bytes of matmul (einsum / dot) results: what tensor parallelism all-reduces."""
    tokens: float
    """Elements of the largest integer input (batch x sequence for a language model)."""
    batch: int
    """Dim 0 of that input: what bounds the pipeline's micro-batches."""
    layer_param_bytes: float
    """Bytes of the repeated blocks' parameters; the rest (embeddings, head) is not split
    evenly by a pipeline and loads its first and last stages."""
    layers: int
    """Repeated blocks: the most parameters that share a path up to a layer index
    (``layers.3.mlp.w1``), or the most iterations of a scan body."""

    @classmethod
    def of(cls, graph: Graph) -> GraphSummary:
        flops = activation = dot = 0.0
        for op in graph.ops:
            ins = tuple(v.type for v in op.operands)
            outs = tuple(v.type for v in op.results)
            flops += op_flops(op.kind, op.rule, ins, outs, op.attrs) * op.repeat
            nbytes = sum(t.nbytes for t in outs) * op.repeat
            activation += nbytes
            if op.kind in ("einsum", "dot", "matmul", "dot_general"):
                dot += nbytes
        params = sum(v.type.nbytes for v in graph.inputs if v.role is Role.PARAMETER)
        states = sum(v.type.nbytes for v in graph.inputs if v.role is Role.OPTIMIZER_STATE)
        ints = [v.type for v in graph.inputs if v.type.dtype.startswith(("i", "u"))]
        largest = max(ints, key=lambda t: t.numel, default=None)
        paths: dict[str, int] = {}
        layer_params = 0.0
        for v in graph.inputs:
            if v.role is Role.PARAMETER and re.search(r"\.\d+\.", v.origin.path):
                key = re.sub(r"\.\d+\.", ".#.", v.origin.path)
                paths[key] = paths.get(key, 0) + 1
                layer_params += v.type.nbytes
        layers = max([*paths.values(), *(op.repeat for op in graph.ops), 1])
        tokens = float(largest.numel) if largest is not None else 1.0
        batch = int(largest.shape[0]) if largest is not None and largest.shape else 1
        return cls(flops, params, states, activation, dot, tokens, batch, layer_params, layers)


def shape_features(
    summary: GraphSummary, shape: dict[str, int], cluster: Cluster, memory_limit: float | None
) -> list[float]:
    """The feature row of one mesh shape (names in ``FEATURES``).

    Role-free: the planner gives any mesh axis any role (the axis named ``tp`` may carry the
    batch), so two shapes that are the same mesh up to axis names are planned alike. The
    features therefore price the best split of the non-pipeline axes into data and tensor
    roles (``_best_roles``) rather than the roles the names suggest, and describe the axes by
    size and link level, not by name. Pipeline depth enters through layers per stage (a stage
    with under one layer is rejected) and the 1F1B bubble ``(p-1)/(m+p-1)`` at the most
    micro-batches the batch allows."""
    pp = shape.get("pp", 1)
    devices = math.prod(shape.values())
    axes = [(name, size) for name, size in shape.items() if size > 1] or [("dp", 1)]
    mesh = Mesh(axes, cluster=cluster.name)
    links = axis_links(mesh, cluster)
    peak = max(dict(cluster.peak_flops).values()) * cluster.compute_efficiency
    compute = max(summary.flops / (devices * peak), 1e-9)
    limit = memory_limit or cluster.hbm_capacity
    inner = [name for name, size in axes if name != "pp" and size > 1]
    roles = _best_roles(summary, shape, inner, mesh, cluster, limit)
    micro = max(1, min(summary.batch // roles.data, MAX_MICROBATCHES)) if pp > 1 else 1
    bubble = (pp - 1) / (micro + pp - 1)
    comm = math.log1p((roles.sync + roles.tp_comm) / compute)
    layers = max(summary.layers, 1)
    head = 1 - min(summary.layer_param_bytes / max(summary.param_bytes, 1.0), 1.0)
    # the busiest stage's matmul work relative to an even split: whole layers, and the output
    # head (about half the non-layer parameters; the embedding lookup does no matmul) on the
    # last stage
    layer_work, head_work = 1 - head, head / 2
    busiest = math.ceil(layers / pp) / layers * layer_work + (head_work if pp > 1 else 0.0)
    load = busiest * pp / (layer_work + head_work) if pp > 1 else 1.0
    return [
        math.log2(pp), math.log2(devices), math.log(compute), comm, roles.sync / compute,
        roles.tp_comm / compute, math.log(max(roles.memory, 1e-6)), float(roles.memory > 1),
        math.log(max(summary.layers, 1) / pp), math.log(max(summary.tokens * pp / devices, 1.0)),
        float(len(inner)), float(sum(links[a] != "intra-node" for a in inner)),
        float(sum(links[a].startswith("inter-island") for a in inner)),
        math.log2(roles.data), math.log2(roles.tensor), bubble,
        comm + math.log1p(bubble / (1 - bubble)), math.log2(micro), head, math.log(load),
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Roles:
    """One split of the non-pipeline axes into data and tensor roles, priced in closed form."""

    data: int
    tensor: int
    sync: float
    """Gradient synchronisation seconds over the data axes (all-reduce, or ZeRO's
    reduce-scatter + all-gather when the replicated state does not fit)."""
    tp_comm: float
    """Activation all-reduces over the tensor axes (about one per matmul pair)."""
    memory: float
    """Per-device bytes over the limit (replicated state, or ZeRO-sharded when that is used)."""


def _best_roles(
    summary: GraphSummary,
    shape: dict[str, int],
    inner: list[str],
    mesh: Mesh,
    cluster: Cluster,
    limit: float,
) -> _Roles:
    """The split of ``inner`` into data / tensor axes that fits memory and communicates least
    (ties: the first in a fixed order, so features are deterministic)."""
    pp = shape.get("pp", 1)
    static = 2 * summary.param_bytes + summary.state_bytes  # weights, gradients, moments
    best: tuple[tuple[bool, float], _Roles] | None = None
    for k in range(len(inner) + 1):
        for data in itertools.combinations(inner, k):
            tensor = tuple(a for a in inner if a not in data)
            d = math.prod(shape[a] for a in data)
            t = math.prod(shape[a] for a in tensor)
            grads = summary.param_bytes / 2 / (t * pp)  # bf16 gradients of this device's layers
            live = summary.activation_bytes / (d * t * pp)
            memory, sync = (static / (t * pp) + live) / limit, 0.0
            if data:
                sync = collective_time("all-reduce", grads, data, mesh, cluster)
            if data and memory > 1:  # ZeRO: reduce-scatter gradients, all-gather weights
                memory = (static / (d * t * pp) + live) / limit
                sync = collective_time("reduce-scatter", grads / d, data, mesh, cluster)
                sync += collective_time("all-gather", grads, data, mesh, cluster)
            tp_comm = 0.0
            if tensor:
                activations = summary.dot_bytes / (d * pp) / 2
                tp_comm = collective_time("all-reduce", activations, tensor, mesh, cluster)
            roles = _Roles(d, t, sync, tp_comm, memory)
            key = (memory > 1, sync + tp_comm)
            if best is None or key < best[0]:
                best = (key, roles)
    assert best is not None
    return best[1]


def target(step_time: float | None, features: Sequence[float]) -> float:
    """The regression target of one planned (or rejected: ``None``) shape."""
    if step_time is None:
        return REJECTED
    return math.log(step_time) - features[FEATURES.index("log_compute")]


@dataclass(frozen=True, slots=True)
class Row:
    """One training row: a mesh shape of one model on one cluster, and the planner's verdict."""

    model: str
    cluster: str
    devices: int
    shape: dict[str, int]
    features: list[float]
    step_time: float | None
    """The full planner's modelled seconds; None when it rejected the shape."""

    def to_json(self) -> dict[str, Any]:
        return dict(model=self.model, cluster=self.cluster, devices=self.devices,
                    shape=self.shape, features=[round(f, 9) for f in self.features],
                    step_time=self.step_time)  # fmt: skip


@dataclass
class Predictor:
    """A fitted regression over ``rows`` (``fit`` makes one; ``load`` reads a model file)."""

    rows: list[Row]
    params: dict[str, Any] = field(default_factory=lambda: dict(PARAMS))
    model: Any = None

    @classmethod
    def fit(cls, rows: Iterable[Row], params: dict[str, Any] | None = None) -> Predictor:
        regressor = _sklearn().GradientBoostingRegressor(**(params or PARAMS))
        rows = list(rows)
        if not rows:
            raise PredictorError("a predictor needs training rows (bench/predictor.py --build)")
        regressor.fit([r.features for r in rows], [target(r.step_time, r.features) for r in rows])
        return cls(rows, dict(params or PARAMS), regressor)

    def predict(self, features: Sequence[Sequence[float]]) -> list[float]:
        """Predicted targets (``target``): lower is faster."""
        return [float(v) for v in self.model.predict([list(f) for f in features])]

    def rank(
        self,
        graph: Graph | GraphSummary,
        shapes: Sequence[dict[str, int]],
        cluster: str | Cluster,
        memory_limit: float | None = None,
    ) -> list[tuple[dict[str, int], float]]:
        """``(shape, predicted seconds)`` best first (``inf`` past ``REJECTED``); ties keep
        the order of ``shapes``, so ranking is deterministic."""
        summary = graph if isinstance(graph, GraphSummary) else GraphSummary.of(graph)
        spec = get_cluster(cluster)
        rows = [shape_features(summary, s, spec, memory_limit) for s in shapes]
        scores = self.predict(rows)
        compute = FEATURES.index("log_compute")
        order = sorted(range(len(shapes)), key=lambda i: (scores[i], i))
        out = []
        for i in order:
            seconds = math.exp(scores[i] + rows[i][compute])
            out.append((shapes[i], seconds if scores[i] < REJECTED / 2 else math.inf))
        return out

    def save(self, path: str | Path) -> Path:
        """Write the model file (format ``FORMAT``; rows sorted, so the file is deterministic)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = dict(format=FORMAT, features=list(FEATURES), params=self.params,
                    rows=[r.to_json() for r in sorted(self.rows, key=_row_key)])  # fmt: skip
        path.write_text(
            json.dumps(data, indent=None, separators=(",", ":")).replace("},{", "},\n{") + "\n"
        )
        return path

    @classmethod
    def load(cls, path: str | Path = MODEL_FILE) -> Predictor:
        """Read a model file and refit it (deterministic; see the module docstring)."""
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT or data.get("features") != list(FEATURES):
            raise PredictorError(
                f"{path}: a predictor file of format {data.get('format')} with other features; "
                f"this shardplan reads format {FORMAT}: rebuild it with bench/predictor.py "
                "--build (or --refeature after a feature change)"
            )
        return cls.fit(read_rows(path), data["params"])


def read_rows(path: str | Path = MODEL_FILE) -> list[Row]:
    """The training rows of a model file, whatever its features (``refeature`` updates them)."""
    data = json.loads(Path(path).read_text())
    return [Row(r["model"], r["cluster"], r["devices"], r["shape"], r["features"],
                r["step_time"]) for r in data["rows"]]  # fmt: skip


def _row_key(row: Row) -> tuple:
    return (row.model, row.cluster, row.devices, tuple(sorted(row.shape.items())))


@lru_cache(maxsize=1)
def default_predictor() -> Predictor:
    """The committed model (``MODEL_FILE``), fitted once per process."""
    return Predictor.load(MODEL_FILE)


def _sklearn() -> Any:
    try:
        import sklearn.ensemble
    except ImportError as error:
        raise PredictorError(
            "the mesh-search predictor needs scikit-learn: pip install 'shardplan[predictor]' "
            "(or plan without mesh_top_k= to search every mesh shape)"
        ) from error
    return sklearn.ensemble


# -- evaluation -------------------------------------------------------------------------------


def _groups(rows: list[Row]) -> dict[tuple, list[Row]]:
    out: dict[tuple, list[Row]] = {}
    for row in rows:
        out.setdefault((row.model, row.cluster, row.devices), []).append(row)
    return out


def family(row: Row) -> str:
    """The model family of a row (``llama3-8b`` of ``llama3-8b/L2/s4096/b8``)."""
    return row.model.split("/")[0]


HOLD_OUT = {"family": family, "cluster": lambda row: row.cluster}
"""How ``cross_validate`` holds configurations out: every configuration of one model family
(or one cluster) at a time, so the scored configurations' family (cluster) is never in
training."""


def held_out_split(rows: list[Row]) -> tuple[list[Row], list[list[Row]]]:
    """Training rows, and the held-out configurations (every fourth group in sorted order)."""
    train, held = [], []
    for n, (_, members) in enumerate(sorted(_groups(rows).items())):
        if n % 4 == 3:
            held.append(members)
        else:
            train.extend(members)
    return train, held


def cross_validate(rows: list[Row], by: str = "family", params: dict | None = None) -> dict:
    """Held-out accuracy of the predictor over every configuration of ``rows``: for each
    model family (``by="family"``) or cluster (``by="cluster"``), fit on the configurations of
    the others and score that one's (``accuracy``). Deterministic (fixed seed)."""
    key = HOLD_OUT[by]
    scored = []
    for held_out in sorted({key(r) for r in rows}):
        train = [r for r in rows if key(r) != held_out]
        held = [m for _, m in sorted(_groups([r for r in rows if key(r) == held_out]).items())]
        scored += _score(Predictor.fit(train, params), held)
    return _summarise(scored)


def accuracy(predictor: Predictor, held: list[list[Row]]) -> dict:
    """Kendall tau and top-1/top-5 recall of ``predictor`` on the held-out configurations
    (``_score``), averaged over them."""
    return _summarise(_score(predictor, held))


def _score(predictor: Predictor, held: list[list[Row]]) -> list[dict]:
    """Per held-out configuration: Kendall tau (``kendall_tau``: over every shape of the
    configuration, the planner's rejected shapes tied last) between the predictor's scores and
    the full planner's step times; top-k recall: whether one of the planner's best shapes (its
    ties included) is among the predictor's first k."""
    out = []
    for members in held:
        truth = [target(r.step_time, r.features) for r in members]
        guess = predictor.predict([r.features for r in members])
        best = {i for i, t in enumerate(truth) if t <= min(truth) + 1e-9}  # the planner's ties
        order = sorted(range(len(members)), key=lambda i: (guess[i], i))
        compute = [r.features[FEATURES.index("log_compute")] for r in members]
        out.append(dict(
            configuration=f"{members[0].model} {members[0].cluster} {members[0].devices}",
            shapes=len(members), tau=kendall_tau(truth, guess), tau_b=kendall_tau_b(truth, guess),
            top1=order[0] in best, top5=bool(best & set(order[:5])),
            truth=[t + c for t, c in zip(truth, compute, strict=True)],
            guess=[g + c for g, c in zip(guess, compute, strict=True)],
        ))  # fmt: skip
    return out


def _summarise(scored: list[dict]) -> dict:
    taus = [s["tau"] for s in scored]
    n = len(scored)
    pooled_true = [t for s in scored for t in s["truth"]]
    pooled_guess = [g for s in scored for g in s["guess"]]
    return dict(
        configurations=n, rows=sum(s["shapes"] for s in scored),
        tau_mean=sum(taus) / n, tau_min=min(taus), tau_median=sorted(taus)[n // 2],
        tau_pooled=kendall_tau(pooled_true, pooled_guess),
        tau_b_mean=sum(s["tau_b"] for s in scored) / n,
        top1_recall=sum(s["top1"] for s in scored) / n,
        top5_recall=sum(s["top5"] for s in scored) / n,
        per_configuration={s["configuration"]: round(s["tau"], 3) for s in scored},
    )  # fmt: skip


def refeature(rows: Iterable[Row]) -> list[Row]:
    """``rows`` with their features recomputed from the grid's graphs (no planning)."""
    from dataclasses import replace

    register_training_clusters()
    configs = {(c.name, c.devices, c.cluster): c for c in training_grid()}
    summaries: dict[str, GraphSummary] = {}
    out = []
    for row in rows:
        config = configs[(row.model, row.devices, row.cluster)]
        if config.name not in summaries:
            summaries[config.name] = GraphSummary.of(config.graph())
        features = shape_features(summaries[config.name], row.shape, get_cluster(row.cluster), None)
        out.append(replace(row, features=[round(f, 9) for f in features]))
    return out


def kendall_tau(truth: Sequence[float], guess: Sequence[float], tie: float = 1e-9) -> float:
    """Kendall's tau over the pairs the planner orders: ``(C - D) / P`` where ``P`` counts the
    pairs whose true values differ by more than ``tie`` (log seconds), ``C`` / ``D`` those of
    them the guess orders the same / the other way (a pair the guess ties counts in ``P``
    only). Pairs the planner ties (two shapes it plans to the same step, two rejected shapes)
    are equally good answers and are left out; ``kendall_tau_b`` counts them as tau-b does."""
    concordant = discordant = pairs = 0
    for i in range(len(truth)):
        for j in range(i + 1, len(truth)):
            d = truth[i] - truth[j]
            if abs(d) <= tie:
                continue
            pairs += 1
            g = guess[i] - guess[j]
            concordant += d * g > 0
            discordant += d * g < 0
    return (concordant - discordant) / pairs if pairs else 1.0


def kendall_tau_b(truth: Sequence[float], guess: Sequence[float]) -> float:
    """Kendall's tau-b (scipy's): ties in either list shrink it, so a planner that ties many
    shapes caps it below 1 even for a perfect ranking of the rest."""
    from scipy.stats import kendalltau

    value = kendalltau(truth, guess).statistic
    return float(value) if value == value else 1.0  # nan: one side constant


# -- training data ----------------------------------------------------------------------------

DCN_TEST_CLUSTER = "h100-dcn-32"
"""h100-superpod-dcn with islands of 32 GPUs: the training grid's island-aware shapes (the
catalogue's islands of 256 leave none at the grid's device counts)."""
TPU_TEST_CLUSTER = "tpu-v5p-slice-16"
"""tpu-v5p-multislice with slices of 16 chips: hosts of 4 chips (so ``tp <= 4``), ICI inside
a slice and DCN across, at the grid's device counts."""


def register_training_clusters() -> None:
    from ..costmodel.cluster import cluster_from_dict, register_cluster

    for base, name, island in (
        ("h100-superpod-dcn", DCN_TEST_CLUSTER, 32),
        ("tpu-v5p-multislice", TPU_TEST_CLUSTER, 16),
    ):
        register_cluster(
            cluster_from_dict({"base": base, "name": name, "islands": [{"devices": island}]})
        )


@dataclass(frozen=True, slots=True)
class Config:
    """One training-step graph (``shardplan.ir.models``) searched on ``devices`` of ``cluster``."""

    model: str
    """A ``shardplan.ir.models.CONFIGS`` name."""
    layers: int
    seq: int
    batch: int
    devices: int
    cluster: str

    @property
    def name(self) -> str:
        return f"{self.model}/L{self.layers}/s{self.seq}/b{self.batch}"

    def graph(self) -> Graph:
        from ..ir.models import CONFIGS, training_step

        return training_step(CONFIGS[self.model], self.batch, self.layers, self.seq)


def training_grid() -> list[Config]:
    """The configurations ``bench/predictor.py --build`` searches in full (fixed order; each
    is a full mesh search, about 10-60 s, so every model has one or two layers).

    The first 16 (four model families on 8-64 devices of h100-sxm, a100-80gb and an island
    cluster) are the original grid; the next 24 add two families (gpt-6.7b, llama2-13b), three
    clusters (h200-sxm, b200, a TPU slice cluster), h100-sxm at 64 devices, and up to 8
    sequences per device, so held-out families and clusters have neighbours in training."""
    out = []
    models = ("gpt-125m", "llama2-7b", "gpt-1.3b", "llama3-8b")
    places = ((8, "h100-sxm"), (16, "a100-80gb"), (32, "h100-sxm"), (64, DCN_TEST_CLUSTER))
    for i, model in enumerate(models):
        for j, (devices, cluster) in enumerate(places):
            seq, per_device = ((1024, 2), (4096, 1))[(i + j) % 2]
            layers = 1 + (i + j // 2) % 2
            out.append(Config(model, layers, seq, per_device * devices, devices, cluster))
    models = ("gpt-6.7b", "llama2-13b", *models)
    places = ((8, "h200-sxm"), (16, "b200"), (32, TPU_TEST_CLUSTER), (64, "h100-sxm"))
    for i, model in enumerate(models):
        for j, (devices, cluster) in enumerate(places):
            seq, per_device = ((2048, 4), (4096, 1), (1024, 8))[(i + j) % 3]
            layers = 1 + (i + j + 1) % 2
            out.append(Config(model, layers, seq, per_device * devices, devices, cluster))
    return out


def search_rows(config: Config, time_limit: float = 5.0) -> list[Row]:
    """Every mesh shape of ``config`` planned in full (``search_mesh``): the training rows
    (``retry_rejected`` re-plans the pp = 1 shapes it rejected)."""
    from .mesh_search import search_mesh

    register_training_clusters()
    graph = config.graph()
    summary = GraphSummary.of(graph)
    spec = get_cluster(config.cluster)
    try:
        table = search_mesh(graph, config.devices, config.cluster, time_limit=time_limit).candidates
    except ShardplanError:
        return []
    features = [shape_features(summary, dict(c.mesh), spec, None) for c in table]
    rows = [
        Row(config.name, config.cluster, config.devices, dict(c.mesh), f, c.step_time)
        for c, f in zip(table, features, strict=True)
    ]
    return retry_rejected(rows, 4 * time_limit)


def retry_rejected(rows: list[Row], time_limit: float) -> list[Row]:
    """``rows`` with each rejected pp = 1 shape planned once more with ``time_limit``.

    On the loaded build box a few pp = 1 shapes came back rejected although they plan (their
    ILP ran out of its time limit), and a shape that looks like a twin of a planned one but is
    labelled rejected teaches the predictor a false cliff. A second, longer try keeps the
    shapes that really fail (out of memory) rejected."""
    from dataclasses import replace

    from .planner import plan_graph

    register_training_clusters()
    configs = {(c.name, c.devices, c.cluster): c for c in training_grid()}
    out = []
    for row in rows:
        if row.step_time is None and row.shape.get("pp", 1) == 1:
            config = configs[(row.model, row.devices, row.cluster)]
            axes = [(a, n) for a, n in row.shape.items() if n > 1] or [("dp", 1)]
            try:
                plan = plan_graph(config.graph(), Mesh(axes, cluster=row.cluster),
                                  time_limit=time_limit)  # fmt: skip
                row = replace(row, step_time=plan.step_time)
            except ShardplanError:
                pass
        out.append(row)
    return out
