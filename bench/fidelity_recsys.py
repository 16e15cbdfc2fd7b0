"""A recommendation training run predicted by the product (issue 38, point 6).

    .venv/bin/python bench/fidelity_recsys.py [--record bench/records/fidelity_recsys.json]


The row: MLPerf Training v3.0, closed division, NVIDIA, ``1xNVIDIA DGX H100`` (8x H100 SXM),
DLRM-DCNv2 with HugeCTR (mlcommons/training_results_v3.0,
``NVIDIA/results/dgxh100_ngc23.04_merlin_hugectr/dlrm_dcnv2/result_0.txt``). The log gives
``global_batch_size`` 55,296 (6,912 per GPU), ``train_samples`` 4,195,197,692, optimizer
``adagrad``, and an evaluation every 0.05 epoch with its start and stop times (``EVAL_LOG``).
Per-iteration time, with nothing but the log: the training time between the first evaluation's
stop (epoch 0.04998) and the last one's start (epoch 0.74990) is 227.805 s of wall clock minus
the 13 evaluations in between (25.607 s), 202.198 s, for (0.74990 - 0.04998) x 4,195,197,692 /
55,296 = 53,101 iterations: **3.808 ms per iteration**. (The first 0.05 epoch, which holds the
warm-up, is left out; it runs 14.634 s against 14.44 s for the others.)

The model (NVIDIA's ``train.py`` of that submission, HugeCTR; and the MLPerf reference
``recommendation_v2/torchrec_dlrm``): 26 tables of the Criteo 1TB multi-hot dataset
(``bench/recsys.py`` ``CRITEO_ROWS``, pooling ``CRITEO_POOLING``: 207 ids per sample), dim 128,
sum pooling; bottom MLP 13-512-256-128; the 26 pooled embeddings concatenated with it (27 x 128
= 3,456); DCNv2 ``MultiCross`` of 3 layers, projection 512 (``x0 * (U V x + b) + x``); top MLP
1024-1024-512-256-1; binary cross-entropy. Mixed precision; Adagrad for tables and dense.

The prediction, nothing fitted to the row:
- **sparse**: ``sp.plan_tables`` on 8 H100 ranks, batch 6,912 per rank, fp32 tables (the
  reference's dtype; HugeCTR keeps fp32 weights), optimizer ``adagrad`` (one fp32 accumulator
  per element, HugeCTR's ``AdaGrad``); the planner's free choice, which, like the run's
  ``SHARDING_PLAN=auto`` with ``DP_SHARDING_THRESHOLD``, replicates the small tables and places
  the large ones model-parallel.
- **dense**: the bottom MLP, the concatenation, DCNv2 and the top MLP with its loss, captured as
  a torch module in fp16 on ``meta`` at the global batch (the pooled embeddings are an input),
  priced by ``sp.evaluate`` under ``sp.strategies.dp()`` on ``{"dp": 8}`` of the calibrated
  H100 (``costmodel.calibration.DEFAULTS``), optimizer ``sgd-momentum`` as the stand-in for
  dense Adagrad (one fp32 state per parameter either way; the capture has no Adagrad update).
- **overlap**: the run's solver sets ``train_intra_iteration_overlap=True`` and
  ``train_inter_iteration_overlap=True``: the embedding's lookups and exchanges run on their own
  streams, concurrently with the dense network of the same and of the next iteration. The row's
  prediction is the two-stream bound ``max(sparse, dense)``; the serial sum (what
  ``TablePlan.iteration_time`` reports, which has no such overlap) is recorded next to it.

Measured (this VM): sparse 2.21 ms, dense 3.45 ms: predicted 3.45 ms (overlapped) vs 3.81
published, -9.4%; the serial sum 5.66 ms is +48.6%. The published time lies between the two:
the overlap is real but not perfect (both streams share HBM bandwidth and SMs, which the
two-stream bound does not charge). Under the bound the dense stream sets the prediction: the
row checks the captured dense pricing and that the tables' time stays below it, not the
tables' time itself (the serial column is where it shows). Known gap, not mended here:
``sp.plan_tables``' own ``DenseSpec`` prices the dense part at ``2 * params`` FLOPs per sample
only (1.0 ms here), which misses DCNv2's elementwise traffic at batch 6,912 (x0 * (...) + x
over 3,456 features, fp16 activations in and out of HBM): the captured dense part is 3.4x that.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardplan.api.records import WallClock, add_record_argument, save_record

SOURCE = (
    "MLPerf Training v3.0 closed, NVIDIA 1xDGX H100 DLRM-DCNv2 HugeCTR "
    "(mlcommons/training_results_v3.0 NVIDIA/results/dgxh100_ngc23.04_merlin_hugectr/"
    "dlrm_dcnv2/result_0.txt)"
)
TRAIN_SAMPLES = 4_195_197_692
GLOBAL_BATCH = 55_296
GPUS = 8
EVAL_LOG = [  # (epoch, eval_start ms, eval_stop ms) from result_0.txt
    (0.049980888109768154, 1683409423124, 1683409425097),
    (0.09997495683348931, 1683409439541, 1683409441510),
    (0.14996902555721045, 1683409455951, 1683409457914),
    (0.19996309428093162, 1683409472358, 1683409474328),
    (0.24995716300465276, 1683409488769, 1683409490733),
    (0.2999512317283739, 1683409505170, 1683409507152),
    (0.34994530045209504, 1683409521592, 1683409523560),
    (0.3999393691758162, 1683409538004, 1683409539976),
    (0.4499334378995374, 1683409554424, 1683409556390),
    (0.4999275066232585, 1683409570837, 1683409572818),
    (0.5499215753469796, 1683409587262, 1683409589228),
    (0.5999156440707009, 1683409603667, 1683409605629),
    (0.649909712794422, 1683409620070, 1683409622035),
    (0.6999037815181431, 1683409636479, 1683409638458),
    (0.7498978502418643, 1683409652902, 1683409654871),
]


def published_iteration() -> float:
    """Seconds per iteration from the log (module docstring): steady training time / steps."""
    first, last = EVAL_LOG[0], EVAL_LOG[-1]
    wall = (last[1] - first[2]) / 1e3
    evals = sum(stop - start for _, start, stop in EVAL_LOG[1:-1]) / 1e3
    iterations = (last[0] - first[0]) * TRAIN_SAMPLES / GLOBAL_BATCH
    return (wall - evals) / iterations


def dense_module():  # type: ignore[no-untyped-def]
    """DLRM-DCNv2's dense part as a plain torch module (the pooled embeddings are an input)."""
    import torch
    from torch import nn

    class Cross(nn.Module):
        def __init__(self, width: int, rank: int) -> None:
            super().__init__()
            self.v = nn.Linear(width, rank, bias=False)
            self.u = nn.Linear(rank, width)

        def forward(self, x0, x):  # type: ignore[no-untyped-def]
            return x0 * self.u(self.v(x)) + x

    def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if last_relu or i < len(sizes) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    class DenseDCNv2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            width = 27 * 128
            self.bottom = mlp([13, 512, 256, 128], last_relu=True)
            self.cross = nn.ModuleList(Cross(width, 512) for _ in range(3))
            self.top = mlp([width, 1024, 1024, 512, 256, 1], last_relu=False)

        def forward(self, dense, pooled, labels):  # type: ignore[no-untyped-def]
            x0 = torch.cat([self.bottom(dense).unsqueeze(1), pooled], dim=1).flatten(1)
            x = x0
            for layer in self.cross:
                x = layer(x0, x)
            logits = self.top(x).squeeze(1)
            return nn.functional.binary_cross_entropy_with_logits(logits, labels)

    return DenseDCNv2()


def dense_time(cluster: str) -> tuple[float, str]:
    """(seconds per iteration of the dense part under data parallelism, its strategy line)."""
    import shardplan as sp
    import torch

    with torch.device("meta"):
        model = dense_module().to(torch.float16)

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.float16, device="meta")

    inputs = {"dense": meta(GLOBAL_BATCH, 13), "pooled": meta(GLOBAL_BATCH, 26, 128),
              "labels": meta(GLOBAL_BATCH)}  # fmt: skip
    mesh = sp.Mesh({"dp": GPUS}, cluster=cluster)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = sp.evaluate(
            model, inputs, mesh=mesh, strategy=sp.strategies.dp(), optimizer="sgd-momentum"
        )
    strategy = next((line for line in str(result.plan).splitlines() if "strategy" in line), "")
    return result.plan.step_time, strategy.strip()


def sparse_plan(cluster: str):  # type: ignore[no-untyped-def]
    """The table planner's plan of the 26 Criteo tables on the run's 8 ranks (no dense part)."""
    import shardplan as sp
    from recsys import criteo

    tables, _ = criteo()
    return sp.plan_tables(
        tables, world=GPUS, cluster=cluster, batch_per_rank=GLOBAL_BATCH // GPUS,
        optimizer="adagrad",
    )  # fmt: skip


def recsys_results() -> list[dict]:
    from fidelity_capture import _calibrated_cluster

    cluster = _calibrated_cluster("h100-sxm")
    start = time.perf_counter()
    tables = sparse_plan(cluster)
    dense, strategy = dense_time(cluster)
    seconds = time.perf_counter() - start
    sparse = tables.sparse_time
    measured = published_iteration()
    predicted = max(sparse, dense)
    types = sorted({c.option.sharding_type for c in tables.choices})
    return [{
        "kind": "recsys training", "source": SOURCE, "row": "DLRM-DCNv2 Criteo 1TB multi-hot",
        "cluster": "h100-sxm", "gpus": GPUS, "global_batch": GLOBAL_BATCH,
        "published_s": measured, "product_s": predicted, "product_error": predicted / measured - 1,
        "sparse_s": sparse, "dense_s": dense, "serial_s": sparse + dense,
        "serial_error": (sparse + dense) / measured - 1, "table_types": types,
        "plan_seconds": seconds, "strategy": strategy,
    }]  # fmt: skip


def recsys_report(results: list[dict]) -> str:
    lines = ["recommendation runs (tables: sp.plan_tables; dense: captured -> sp.evaluate):"]
    lines.append(f"  {'row':<34} {'pub ms':>7} {'pred ms':>8} {'error':>7} {'sparse':>7} "
                 f"{'dense':>7} {'serial':>7} {'error':>7}")  # fmt: skip
    for r in results:
        lines.append(
            f"  {r['row']:<34} {r['published_s'] * 1e3:>7.3f} {r['product_s'] * 1e3:>8.3f} "
            f"{r['product_error']:>+7.1%} {r['sparse_s'] * 1e3:>7.3f} {r['dense_s'] * 1e3:>7.3f} "
            f"{r['serial_s'] * 1e3:>7.3f} {r['serial_error']:>+7.1%}"
        )
        lines.append(f"  tables: {', '.join(r['table_types'])}; dense: {r['strategy']}")
    lines += [f"  source: {r['source']}" for r in results[:1]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_argument(parser)
    args = parser.parse_args(argv)
    clock = WallClock()
    results = recsys_results()
    print(recsys_report(results))
    save_record(args, "fidelity_recsys", results=results, wall_times=clock.total())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
