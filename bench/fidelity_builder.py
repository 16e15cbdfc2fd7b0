"""A published run predicted by ``sp.evaluate`` on the IR builder's model (no framework).

``bench/fidelity.py --builder`` uses this for the Llama 3 405B rows (reference sheet §2.3):
the whole training step built by ``shardplan.ir.models.training_step`` at the row's shapes and
global batch (every layer, embedding, logits head, loss, AdamW; causal attention), priced by
``sp.evaluate`` under the row's ``sp.strategies.megatron(...)`` on its ``{"pp", "dp", "tp"}``
mesh, plus ``"cp"`` for the 128K row (``megatron(cp="cp")``: the sequence and attention's
queries split over it, K/V all-gathered, head-tail balanced causal work). The calibrated
cluster is the other fidelity paths' (one calibration per GPU generation). Building a 405B
step takes seconds, where capturing one through torch takes minutes.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from functools import cache

from fidelity_capture import _calibrated_cluster
from fidelity_product import strategy_of
from transformer_cost import Config, Model


@dataclass(frozen=True, slots=True)
class BuilderPrediction:
    step_time: float
    """Modelled seconds per iteration (``sp.evaluate``'s step)."""
    seconds: float
    """Wall seconds of building plus evaluation."""


def strategy(c: Config):
    """The row's configuration as ``sp.strategies.megatron``, with ``cp`` on the "cp" axis."""
    import shardplan as sp

    if c.cp == 1:
        return strategy_of(c)
    return sp.strategies.megatron(
        tp="tp",
        pp=c.pp,
        cp="cp",
        microbatches=c.microbatches,
        sequence_parallel=c.sequence_parallel,
        recompute=None if c.recompute == "none" else c.recompute,
        zero1=c.distributed_optimizer and c.dp > 1,
        chunks=c.chunks,
    )


@cache
def builder_prediction(m: Model, c: Config, cluster: str) -> BuilderPrediction:
    """``sp.evaluate`` of the builder's whole training step under the row's configuration."""
    import shardplan as sp
    from shardplan.ir.models import TransformerConfig, training_step

    start = time.perf_counter()
    arch = "llama" if m.gated_mlp else "gpt"
    config = TransformerConfig(m.name, m.layers, m.hidden, m.heads, m.ffn, m.vocab, c.seq, arch,
                               m.kv_heads)  # fmt: skip
    graph = training_step(config, batch=c.global_batch)
    axes = {"pp": c.pp, "dp": c.dp, "tp": c.tp} | ({"cp": c.cp} if c.cp > 1 else {})
    mesh = sp.Mesh(axes, cluster=_calibrated_cluster(cluster))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ev = sp.evaluate(graph, mesh=mesh, strategy=strategy(c), memory_limit=math.inf)
    return BuilderPrediction(ev.step_time, time.perf_counter() - start)
