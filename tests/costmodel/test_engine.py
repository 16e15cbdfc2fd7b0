"""Execution engines: kernel floors and elementwise launches per engine (issue 41)."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.costmodel import get_cluster
from shardplan.costmodel.cluster import ClusterConfigError
from shardplan.costmodel.engine import GRAPH_KERNEL_FLOOR, launches, with_engine
from shardplan.ir.models import TransformerConfig, training_step

TINY = TransformerConfig("tiny-engine", 2, 64, 2, 128, 256, 64)


def test_engine_sets_the_floor_and_the_elementwise_launches():
    eager = get_cluster(with_engine("h100-sxm", "eager"))
    graph = get_cluster(with_engine("h100-sxm", "cuda_graph"))
    fused = get_cluster(with_engine("h100-sxm", "fused"))
    assert eager is get_cluster("h100-sxm")
    assert eager.kernel_floor > graph.kernel_floor == GRAPH_KERNEL_FLOOR == fused.kernel_floor
    assert graph.name == "h100-sxm+cuda_graph"
    # an elementwise add launches its own kernel except under the fused engine
    assert launches("add", True, eager)
    assert launches("add", True, graph)
    assert not launches("add", True, fused)
    assert launches("dot", True, fused)  # GEMMs always launch
    assert not launches("dot", False, eager)  # folded by the elementwise fusion


def test_unknown_engine_names_the_choices():
    with pytest.raises(ClusterConfigError, match=r"unknown engine 'graphs'.*cuda_graph"):
        with_engine("h100-sxm", "graphs")


def test_a_launch_bound_step_is_cheaper_on_faster_engines():
    """A tiny step is all kernel floors: eager > cuda_graph > fused, same plan shape."""
    steps = {}
    for engine in ("eager", "cuda_graph", "fused"):
        mesh = sp.Mesh({"dp": 1}, cluster=with_engine("h100-sxm", engine))
        steps[engine] = sp.plan(training_step(TINY, batch=2), mesh=mesh).step_time
    assert steps["eager"] > steps["cuda_graph"] > steps["fused"] > 0
    # floors dominate: the eager step is close to floor-ratio times the CUDA-graph one
    assert steps["eager"] / steps["cuda_graph"] > 1.5
