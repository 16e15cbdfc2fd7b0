"""A learned performance predictor that ranks mesh shapes before they are planned (CubicML).

Mesh search (``solver/mesh_search.py``) plans every (pp, [dcn,] dp, tp) shape in full: an
intra-op ILP per shape, and a stage assignment when ``pp > 1``. Most of that time goes to shapes
that lose. The predictor is a small gradient-boosted regression (scikit-learn) from cheap
*configuration features* to the planner's own modelled step time; the search plans only the
``top_k`` shapes it ranks best (``sp.plan(..., devices=N, mesh_top_k=3)``).

Features (``shape_features``) are a few closed forms computed from the graph once (global
FLOPs, parameter / optimizer-state / activation bytes) and, per shape, from the cost model's
own collective prices: the ideal compute time on all devices, the data-parallel gradient
all-reduce and the tensor-parallel activation all-reduces relative to it, per-device memory
relative to the limit with and without ZeRO, the degrees and the links their axes cross. The
target is ``log(step_time / ideal compute)``: dimensionless, so one model serves models of any
size; a shape the planner rejects (out of memory) is learned as ``REJECTED``.

The model file (``data/predictor/model.json``) is versioned and plain JSON: the training rows
(features and targets, made by ``bench/predictor.py --build`` from full mesh searches), the
feature names and the hyper-parameters. Loading refits the regression from those rows, which
is deterministic (fixed seed) and takes well under a second, so no pickle ties the file to one
scikit-learn build; ``tests/test_predictor.py`` rebuilds some rows with the planner and checks
they equal the committed ones.

scikit-learn is an optional dependency (``pip install shardplan[predictor]``); it is imported
only when a predictor is fitted, so ``import shardplan`` and the planner work without it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from .costmodel import collective_time, get_cluster
from .costmodel.cluster import Cluster
from .ir import Graph, Mesh, ShardplanError
from .ir.graph import Role
from .ir.registry import op_flops

FORMAT = 1
"""Version of the model file; a file of another version is refused (rebuild it)."""
MODEL_FILE = Path(__file__).resolve().parent / "data" / "predictor" / "model.json"
REJECTED = 6.0
"""Target of a shape the planner rejects: e^6 ~ 400x the ideal compute time, worse than any
planned shape in the training set, so rejected shapes rank last."""
FEATURES = (
    "log_pp", "log_dp", "log_dcn", "log_tp", "log_devices", "log_compute",
    "grad_sync", "grad_sync_zero", "tp_comm", "log_mem", "log_mem_zero",
    "log_tokens_per_replica", "log_layers", "log_layers_per_stage",
)  # fmt: skip
PARAMS = dict(n_estimators=400, max_depth=4, learning_rate=0.05, subsample=1.0, random_state=0)


class PredictorError(ShardplanError):
    """The predictor cannot be used: scikit-learn missing, or a model file of another version."""


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
        ints = [v.type.numel for v in graph.inputs if v.type.dtype.startswith(("i", "u"))]
        paths: dict[str, int] = {}
        for v in graph.inputs:
            if v.role is Role.PARAMETER and re.search(r"\.\d+\.", v.origin.path):
                key = re.sub(r"\.\d+\.", ".#.", v.origin.path)
                paths[key] = paths.get(key, 0) + 1
        layers = max([*paths.values(), *(op.repeat for op in graph.ops), 1])
        return cls(flops, params, states, activation, dot, float(max(ints, default=1)), layers)


def shape_features(
    summary: GraphSummary, shape: dict[str, int], cluster: Cluster, memory_limit: float | None
) -> list[float]:
    """The feature row of one mesh shape (names in ``FEATURES``; module docstring)."""
    pp, tp, dcn = shape.get("pp", 1), shape.get("tp", 1), shape.get("dcn", 1)
    dp = shape.get("dp", 1) * dcn
    devices = pp * dp * tp
    axes = [(name, size) for name, size in shape.items() if size > 1] or [("dp", 1)]
    mesh = Mesh(axes, cluster=cluster.name)
    peak = max(dict(cluster.peak_flops).values()) * cluster.compute_efficiency
    compute = max(summary.flops / (devices * peak), 1e-9)
    data_axes = tuple(a for a in ("dcn", "dp") if shape.get(a, 1) > 1)
    grads = summary.param_bytes / 2 / (tp * pp)  # bf16 gradients of this device's layers
    sync = collective_time("all-reduce", grads, data_axes, mesh, cluster) if data_axes else 0.0
    zero = 0.0
    if data_axes:  # ZeRO: reduce-scatter gradients, all-gather weights (both per data axis)
        zero = collective_time("reduce-scatter", grads / dp, data_axes, mesh, cluster)
        zero += collective_time("all-gather", grads, data_axes, mesh, cluster)
    tp_comm = 0.0
    if tp > 1:  # about one activation all-reduce per matmul pair, on this device's tokens
        per_device = summary.dot_bytes / (dp * pp) / 2
        tp_comm = collective_time("all-reduce", per_device, "tp", mesh, cluster)
    limit = memory_limit or cluster.hbm_capacity
    static = 2 * summary.param_bytes + summary.state_bytes  # weights, gradients, moments
    live = summary.activation_bytes / (dp * tp * pp)
    mem = (static / (tp * pp) + live) / limit
    mem_zero = (static / devices + live) / limit
    return [
        math.log2(pp), math.log2(dp), math.log2(dcn), math.log2(tp), math.log2(devices),
        math.log(compute), sync / compute, zero / compute, tp_comm / compute,
        math.log(max(mem, 1e-6)),
        math.log(max(mem_zero, 1e-6)), math.log(max(summary.tokens / dp, 1.0)),
        math.log(max(summary.layers, 1)), math.log(max(summary.layers, 1) / pp),
    ]  # fmt: skip


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


def held_out_split(rows: list[Row]) -> tuple[list[Row], list[list[Row]]]:
    """Training rows, and the held-out configurations (every fourth group in sorted order)."""
    train, held = [], []
    for n, (_, members) in enumerate(sorted(_groups(rows).items())):
        if n % 4 == 3:
            held.append(members)
        else:
            train.extend(members)
    return train, held


def accuracy(predictor: Predictor, held: list[list[Row]]) -> dict:
    """Kendall tau and top-1/top-5 recall of ``predictor`` on the held-out configurations:
    top-k recall is the share of configurations where one of the planner's best shapes (its
    ties included) is among the predictor's first k."""
    taus, taus_b, top1, top5, pooled_true, pooled_pred = [], [], 0, 0, [], []
    for members in held:
        truth = [target(r.step_time, r.features) for r in members]
        guess = predictor.predict([r.features for r in members])
        taus.append(kendall_tau(truth, guess))
        taus_b.append(kendall_tau_b(truth, guess))
        best = {i for i, t in enumerate(truth) if t <= min(truth) + 1e-9}  # the planner's ties
        order = sorted(range(len(members)), key=lambda i: (guess[i], i))
        top1 += order[0] in best
        top5 += bool(best & set(order[:5]))
        compute = [r.features[FEATURES.index("log_compute")] for r in members]
        pooled_true += [t + c for t, c in zip(truth, compute, strict=True)]
        pooled_pred += [g + c for g, c in zip(guess, compute, strict=True)]
    return dict(
        configurations=len(held), rows=sum(len(m) for m in held),
        tau_mean=sum(taus) / len(taus), tau_min=min(taus),
        tau_pooled=kendall_tau(pooled_true, pooled_pred),
        tau_b_mean=sum(taus_b) / len(taus_b),
        top1_recall=top1 / len(held), top5_recall=top5 / len(held),
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


def register_training_clusters() -> None:
    from .costmodel.cluster import cluster_from_dict, register_cluster

    data = {"base": "h100-superpod-dcn", "name": DCN_TEST_CLUSTER, "islands": [{"devices": 32}]}
    register_cluster(cluster_from_dict(data))


@dataclass(frozen=True, slots=True)
class Config:
    """One training-step graph (``shardplan.models``) searched on ``devices`` of ``cluster``."""

    model: str
    """A ``shardplan.models.CONFIGS`` name."""
    layers: int
    seq: int
    batch: int
    devices: int
    cluster: str

    @property
    def name(self) -> str:
        return f"{self.model}/L{self.layers}/s{self.seq}/b{self.batch}"

    def graph(self) -> Graph:
        from .models import CONFIGS, training_step

        return training_step(CONFIGS[self.model], self.batch, self.layers, self.seq)


def training_grid() -> list[Config]:
    """The configurations ``bench/predictor.py --build`` searches in full (fixed order): four
    model families, one or two layers, two sequence lengths, 8-64 devices on three clusters (one
    with islands); each is a full mesh search (about 10-60 s), so the grid stays small."""
    out = []
    models = ("gpt-125m", "llama2-7b", "gpt-1.3b", "llama3-8b")
    places = ((8, "h100-sxm"), (16, "a100-80gb"), (32, "h100-sxm"), (64, DCN_TEST_CLUSTER))
    for i, model in enumerate(models):
        for j, (devices, cluster) in enumerate(places):
            seq, per_device = ((1024, 2), (4096, 1))[(i + j) % 2]
            layers = 1 + (i + j // 2) % 2
            out.append(Config(model, layers, seq, per_device * devices, devices, cluster))
    return out


def search_rows(config: Config, time_limit: float = 5.0) -> list[Row]:
    """Every mesh shape of ``config`` planned in full (``search_mesh``): the training rows."""
    from .solver.mesh_search import search_mesh

    register_training_clusters()
    graph = config.graph()
    summary = GraphSummary.of(graph)
    spec = get_cluster(config.cluster)
    try:
        table = search_mesh(graph, config.devices, config.cluster, time_limit=time_limit).candidates
    except ShardplanError:
        return []
    features = [shape_features(summary, dict(c.mesh), spec, None) for c in table]
    return [
        Row(config.name, config.cluster, config.devices, dict(c.mesh), f, c.step_time)
        for c, f in zip(table, features, strict=True)
    ]
