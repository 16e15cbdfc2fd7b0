"""A published run predicted end to end by the product: ``sp.evaluate`` on the captured model.

``bench/fidelity.py --product`` uses this for its product column: each row's whole transformer
(every layer, the embedding, the logits head and the loss; HF classes on ``meta`` as in
``fidelity_capture.py``) is captured through the torch frontend with the row's global batch,
and ``sp.evaluate`` prices ``sp.strategies.megatron(tp=..., pp=..., microbatches=...,
sequence_parallel=..., recompute=..., zero1=True)`` on a ``{"pp", "dp", "tp"}`` mesh of the
row's calibrated cluster: the pipeline (``plan_pipeline``'s stage model, equal stages), the
data-parallel gradient reduction and the optimizer all come from the product's cost model.
Nothing from ``transformer_cost.py`` enters the prediction.

Rows that ran interleaved 1F1B (``chunks > 1``) are evaluated with ``megatron(..., chunks=v)``,
rows with TP communication overlap with ``tp_comm_overlap=True`` (inside pipeline stages too).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from functools import cache

from fidelity_capture import _calibrated_cluster, _hf_model
from transformer_cost import Config, Model


@dataclass(frozen=True, slots=True)
class ProductPrediction:
    step_time: float
    """Modelled seconds per iteration (``sp.evaluate``'s step)."""
    peak_memory_bytes: int
    """Per-device peak (the fullest pipeline stage)."""
    bubble: float
    """The pipeline's bubble fraction (0 without a pipeline)."""
    seconds: float
    """Wall seconds of capture plus evaluation."""


def strategy_of(c: Config):
    """The row's configuration as a ``sp.strategies.megatron`` strategy."""
    import shardplan as sp

    return sp.strategies.megatron(
        tp=c.tp,
        pp=c.pp,
        microbatches=c.microbatches,
        sequence_parallel=c.sequence_parallel,
        recompute=None if c.recompute == "none" else c.recompute,
        zero1=c.distributed_optimizer and c.dp > 1,
        chunks=c.chunks,
        tp_comm_overlap=c.tp_overlap and c.sequence_parallel and c.tp > 1,
    )


@cache
def product_prediction(m: Model, c: Config, cluster: str) -> ProductPrediction:
    """``sp.evaluate`` of the whole captured model under the row's configuration."""
    import shardplan as sp
    import torch

    start = time.perf_counter()
    model = _hf_model(m, m.layers, c.seq, c.flash_attention)
    ids = torch.empty((c.global_batch, c.seq), dtype=torch.long, device="meta")
    mesh = sp.Mesh({"pp": c.pp, "dp": c.dp, "tp": c.tp}, cluster=_calibrated_cluster(cluster))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ev = sp.evaluate(
            model, {"input_ids": ids, "labels": ids}, mesh=mesh, strategy=strategy_of(c),
            memory_limit=math.inf,
        )  # fmt: skip
    pipe = ev.plan.pipeline
    return ProductPrediction(
        ev.step_time,
        ev.peak_memory_bytes,
        pipe.bubble_fraction if pipe is not None else 0.0,
        time.perf_counter() - start,
    )
