"""The learned mesh-search predictor (``predictor.py``, issue 20 part 2): its committed training
rows are what the planner and the feature code give today, it ranks held-out configurations as
the full planner does (Kendall tau, top-k recall), and its top-k search chooses the exhaustive
search's mesh on the bench models."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import shardplan as sp
from shardplan.ir import ShardplanError
from shardplan.solver.mesh_search import _tied
from shardplan.solver.predictor import (
    MODEL_FILE,
    Config,
    Predictor,
    cross_validate,
    default_predictor,
    kendall_tau,
    refeature,
    register_training_clusters,
    training_grid,
)

EXHAUSTIVE = MODEL_FILE.parent / "exhaustive.json"
TOP_K = 3  # bench/predictor.py's


@pytest.fixture(scope="module")
def committed() -> Predictor:
    return Predictor.load(MODEL_FILE)


def test_model_file_is_deterministic_and_its_features_match_the_code(
    committed: Predictor, tmp_path: Path
) -> None:
    """Saving the loaded rows gives the committed bytes back, and recomputing every row's
    features from its graph (no planning) gives the committed features: the file is current."""
    assert (
        Predictor(committed.rows).save(tmp_path / "m.json").read_bytes() == MODEL_FILE.read_bytes()
    )
    fresh = refeature(committed.rows)
    for old, new in zip(committed.rows, fresh, strict=True):
        assert new.features == pytest.approx(old.features, rel=1e-7, abs=1e-8), old.shape
    assert {r.model for r in committed.rows} == {c.name for c in training_grid()}


def test_rebuilt_rows_equal_the_committed_ones(committed: Predictor) -> None:
    """Two shapes of the cheapest grid configuration planned again (as ``search_mesh`` plans
    them) give the committed step times; a pipeline deeper than the model is rejected again."""
    from shardplan.solver.pipeline import plan_pipeline
    from shardplan.solver.planner import plan_graph

    config = training_grid()[0]
    graph = config.graph()
    rows = {tuple(r.shape.items()): r for r in committed.rows if r.model == config.name}
    for shape in ({"pp": 1, "dp": 8, "tp": 1}, {"pp": 1, "dp": 2, "tp": 4}):
        axes = [(a, n) for a, n in shape.items() if n > 1]
        plan = plan_graph(graph, sp.Mesh(axes, cluster=config.cluster), time_limit=5.0)
        assert plan.step_time == pytest.approx(rows[tuple(shape.items())].step_time, rel=1e-9)
    deep = {"pp": 8, "dp": 1, "tp": 1}
    assert rows[tuple(deep.items())].step_time is None
    with pytest.raises(ShardplanError):
        plan_pipeline(graph, sp.Mesh({"pp": 8}, cluster=config.cluster), time_limit=5.0)


def test_held_out_families_rank_as_the_full_planner_does(committed: Predictor) -> None:
    """Fitted without a model family, the predictor orders the shapes of that family's
    configurations as the full planner does (every family held out in turn, so every
    configuration is scored by a predictor that never saw its model): issue 20's bar, Kendall
    tau >= 0.9 per configuration on average, and the planner's best shape among the
    predictor's first five everywhere. Measured (bench/predictor.py, docs/design.md): tau
    0.963 mean (median 0.961, min 0.828), top-5 recall 1.00; the floors are the issue's bar,
    so a predictor that falls under it fails."""
    scores = cross_validate(committed.rows, "family")
    assert scores["configurations"] == len(training_grid())
    assert scores["tau_mean"] >= 0.9, scores
    assert scores["tau_median"] >= 0.9, scores
    assert scores["top5_recall"] == 1.0, scores


def test_features_are_role_free() -> None:
    """The planner gives any axis any role, so shapes that are the same mesh up to axis names
    get the same features (one node: ``dp=8`` and ``tp=8``), and shapes that differ in the
    links their axes cross do not (``dp=16`` over two nodes vs ``dp=2 x tp=8``)."""
    from shardplan.costmodel import get_cluster
    from shardplan.solver.predictor import GraphSummary, shape_features

    summary = GraphSummary.of(training_grid()[0].graph())
    spec = get_cluster("h100-sxm")
    row = lambda **shape: shape_features(summary, {"pp": 1, **shape}, spec, None)  # noqa: E731
    assert row(dp=8, tp=1) == row(dp=1, tp=8)
    assert row(dp=4, tp=2) == row(dp=2, tp=4)
    assert row(dp=16, tp=1) != row(dp=2, tp=8)


def test_kendall_tau_leaves_out_the_planners_ties_only() -> None:
    """Pairs the planner ties are no error either way; pairs the predictor ties are."""
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert kendall_tau([1, 1, 3], [20, 10, 30]) == 1.0  # the planner's tie: left out
    assert kendall_tau([1, 2, 3], [10, 10, 30]) == pytest.approx(2 / 3)  # the guess's tie: counted


def _bench_configs() -> list[tuple[Config, dict]]:
    out = []
    for name, entry in json.loads(EXHAUSTIVE.read_text()).items():
        model, layers, seq, batch = name.split("/")
        config = Config(model, int(layers[1:]), int(seq[1:]), int(batch[1:]), entry["devices"],
                        entry["cluster"])  # fmt: skip
        out.append((config, entry))
    return out


def test_top_k_picks_the_exhaustive_mesh_on_the_bench_models() -> None:
    """On each bench model (256 devices: 4x the grid's largest, not in the training grid),
    planning the predictor's top-k in its order (the recorded exhaustive step times stand in
    for the plans: planning is deterministic) chooses the mesh the exhaustive search chose, and
    plans at most k + 1 shapes (ties share the k-th place)."""
    register_training_clusters()
    assert _bench_configs()
    for config, entry in _bench_configs():
        steps = {tuple(t["mesh"].items()): t["step_time"] for t in entry["table"]}
        order = [tuple(t["mesh"].items()) for t in entry["table"]]
        ranked = default_predictor().rank(config.graph(), [dict(s) for s in order], config.cluster)
        planned, kth = [], 0.0
        for shape, guess in ranked:  # as search_mesh: the k-th place shared by the tied
            if len(planned) >= TOP_K and not _tied(guess, kth):
                break
            if steps[tuple(shape.items())] is not None:
                planned.append(tuple(shape.items()))
                kth = guess if len(planned) == TOP_K else kth
        chosen = min(planned, key=lambda s: (steps[s], order.index(s)))
        exhaustive = min((s for s in order if steps[s] is not None),
                         key=lambda s: (steps[s], order.index(s)))  # fmt: skip
        assert chosen == exhaustive, (config.name, chosen, exhaustive)
        assert len(planned) <= TOP_K + 1, planned
        live = {a: n for a, n in exhaustive if n > 1}
        assert live == {a: n for a, n in entry["mesh"].items() if n > 1}


@pytest.mark.slow
def test_top_k_search_end_to_end_matches_the_exhaustive_search() -> None:
    """``sp.plan(devices=256, mesh_top_k=3)`` on the smallest bench model plans three shapes
    (four when the predictor ties the third place), lists the others as skipped, and returns
    the exhaustive search's mesh and step time."""
    config, entry = min(_bench_configs(), key=lambda c: c[0].model != "gpt-125m")
    plan = sp.plan(config.graph(), devices=config.devices, cluster=config.cluster,
                   mesh_top_k=TOP_K, time_limit=5.0)  # fmt: skip
    best = min(t["step_time"] for t in entry["table"] if t["step_time"] is not None)
    assert plan.step_time == pytest.approx(best, rel=1e-9)
    assert dict(plan.mesh.axes) == {a: n for a, n in entry["mesh"].items() if n > 1}
    planned = [c for c in plan.candidates if c.step_time is not None]
    skipped = [c for c in plan.candidates if "top-k" in c.rejected]
    assert TOP_K <= len(planned) <= TOP_K + 1  # the k-th place may be shared (ties)
    assert len(plan.candidates) == len(entry["table"])
    assert len(skipped) >= len(entry["table"]) - 2 * TOP_K
    assert all(c.rejected.startswith("not planned: predicted") for c in skipped)


def test_mesh_top_k_is_checked() -> None:
    graph = training_grid()[0].graph()
    with pytest.raises(sp.ArgumentError, match="mesh_top_k"):
        sp.plan(graph, devices=8, mesh_top_k=0)


def test_planner_imports_without_scikit_learn_and_top_k_says_what_to_install() -> None:
    """scikit-learn is optional: blocked, ``import shardplan`` and the predictor module load,
    and only a ``mesh_top_k`` search fails, naming the package to install."""
    script = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "sklearn":
                    raise ImportError("sklearn is blocked for this test")
                return None

        sys.meta_path.insert(0, Block())
        import shardplan as sp
        from shardplan.solver import predictor
        from shardplan.ir.models import GPT_125M, training_step
        try:
            sp.plan(training_step(GPT_125M, 8, 1, 128), devices=8, mesh_top_k=2)
        except predictor.PredictorError as error:
            print("refused:", error)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout
    assert "scikit-learn" in result.stdout
