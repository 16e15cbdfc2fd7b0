"""Calibration: the cost model's efficiency factors as parameters, fittable from measurements.

A ``Calibration`` holds one GPU generation's achievable fractions of the datasheet numbers:

- **matmul efficiency by size**: ``eff(F) = e_max * F / (F + F_half)`` for a GEMM of ``F``
  FLOPs - small GEMMs cannot fill the machine (Calculon's size-bucketed table, ref §5, is the
  step-function form of the same idea; the saturating curve is our smooth re-derivation);
- **convolution efficiency**: the fraction of peak a full-tile implicit-GEMM convolution
  reaches (0: the GEMM's; ``costmodel/conv.py`` adds tile quantisation), fitted from the
  ``conv`` rows of ``bench/microbench_gpu.py``;
- **memory efficiency**: achieved / datasheet HBM bandwidth (ref §3: 0.70-0.84);
- **collective bus-bandwidth efficiency** per link level: a multiplier on the catalogue's busbw
  (the catalogue already holds *measured* busbw, so the default is 1.0);
- **kernel floor**: the least time any kernel takes (autoparallel's 7 us).

``fit(measurements)`` estimates them from a JSON written by ``bench/microbench_gpu.py``;
``apply(calibration, cluster)`` returns a new ``Cluster`` carrying them.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from .cluster import Cluster, ClusterConfigError, LinkLevel, get_cluster


@dataclass(frozen=True, slots=True)
class Calibration:
    """Achievable fractions of one device generation's datasheet rates.

    Invariants: efficiencies lie in (0, 1] (bus-bandwidth multipliers in (0, 2]); FLOPs and
    seconds are positive.
    """

    name: str
    matmul_efficiency: float = 0.80
    """``e_max``: fraction of dense peak a large GEMM reaches."""
    matmul_half_flops: float = 2e9
    """``F_half``: GEMM FLOPs at which the efficiency is half of ``e_max``."""
    attention_efficiency: float = 0.50
    """Fraction of dense peak a fused (flash) attention kernel reaches on its causal FLOPs."""
    attention_backward_slowdown: float = 1.0
    """Fused attention backward seconds over 2.5x the forward's (the FLOP ratio of its five
    matmuls to two): the backward kernel's efficiency is ``attention_efficiency`` divided by
    this."""
    memory_efficiency: float = 0.80
    conv_efficiency: float = 0.0
    """Fraction of dense peak a full-tile implicit-GEMM convolution reaches; 0: the GEMM's
    ``matmul_efficiency`` (``costmodel/conv.py`` adds the tile quantisation)."""
    intra_busbw_efficiency: float = 1.0
    inter_busbw_efficiency: float = 1.0
    comm_sm_share: float = 0.0
    """Fraction of the SMs a collective occupies while it runs beside compute: NCCL runs one
    CTA per channel, so compute overlapped with it runs at ``1 - comm_sm_share`` of its
    rate."""
    kernel_floor: float = 7e-6
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("matmul_efficiency", "attention_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ClusterConfigError(f"calibration {self.name!r}: {name} not in (0, 1]")
        if not 0 <= self.conv_efficiency <= 1:
            raise ClusterConfigError(f"calibration {self.name!r}: conv_efficiency not in [0, 1]")
        for name in ("intra_busbw_efficiency", "inter_busbw_efficiency"):
            if not 0 < getattr(self, name) <= 2:
                raise ClusterConfigError(f"calibration {self.name!r}: {name} not in (0, 2]")
        if not 1 <= self.attention_backward_slowdown <= 4:
            raise ClusterConfigError(
                f"calibration {self.name!r}: attention_backward_slowdown not in [1, 4]"
            )
        if not 0 <= self.comm_sm_share < 1:
            raise ClusterConfigError(f"calibration {self.name!r}: comm_sm_share not in [0, 1)")
        if self.matmul_half_flops < 0 or self.kernel_floor < 0:
            raise ClusterConfigError(f"calibration {self.name!r}: negative half-flops or floor")

    def matmul_efficiency_at(self, flops: float) -> float:
        """Fraction of peak a GEMM of ``flops`` FLOPs reaches (saturating curve)."""
        if flops <= 0:
            return self.matmul_efficiency
        return self.matmul_efficiency * flops / (flops + self.matmul_half_flops)

    def attention_time(self, flops: float, cluster: Cluster, dtype: str = "bf16") -> float:
        """Time of a fused attention kernel doing ``flops`` (causal FLOPs, as FA counts them)."""
        if flops <= 0:
            return 0.0
        return max(flops / (cluster.peak(dtype) * self.attention_efficiency), self.kernel_floor)

    def attention_backward_time(self, forward_seconds: float) -> float:
        """Backward seconds of a fused attention kernel whose forward takes ``forward_seconds``:
        2.5x the FLOPs (FlashAttention-2's five matmuls to two), at the backward's rate."""
        return 2.5 * forward_seconds * self.attention_backward_slowdown

    def overlap_penalty(self, hidden_seconds: float) -> float:
        """Seconds compute loses to a collective hidden under it for ``hidden_seconds``: the
        collective's SMs do no compute meanwhile (``comm_sm_share``)."""
        return hidden_seconds * self.comm_sm_share / (1 - self.comm_sm_share)

    def matmul_time(self, flops: float, nbytes: float, dtype: str, cluster: Cluster) -> float:
        """Roofline time of a GEMM with the size-dependent efficiency and the kernel floor."""
        if flops <= 0 and nbytes <= 0:
            return 0.0
        math_time = flops / (cluster.peak(dtype) * self.matmul_efficiency_at(flops))
        return max(math_time, self.memory_time(nbytes, cluster), self.kernel_floor)

    def memory_time(self, nbytes: float, cluster: Cluster) -> float:
        """Time of a memory-bound kernel moving ``nbytes`` through HBM (with the floor)."""
        if nbytes <= 0:
            return 0.0
        return max(nbytes / (cluster.hbm_bandwidth * self.memory_efficiency), self.kernel_floor)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def apply(calibration: Calibration, cluster: Cluster | str) -> Cluster:
    """A copy of ``cluster`` with the calibration's efficiencies, link bandwidths and floor.

    ``Cluster`` has one compute efficiency, so it gets the large-GEMM asymptote; callers that
    want the size dependence use ``Calibration.matmul_time``.
    """
    base = get_cluster(cluster)
    intra, inter = base.intra_node, base.inter_node
    return replace(
        base,
        name=f"{base.name}+{calibration.name}",
        compute_efficiency=calibration.matmul_efficiency,
        memory_efficiency=calibration.memory_efficiency,
        attention_efficiency=calibration.attention_efficiency,
        attention_backward_slowdown=calibration.attention_backward_slowdown,
        conv_efficiency=calibration.conv_efficiency,
        kernel_floor=calibration.kernel_floor,
        intra_node=LinkLevel(
            intra.name, intra.bandwidth * calibration.intra_busbw_efficiency, intra.latency
        ),
        inter_node=LinkLevel(
            inter.name, inter.bandwidth * calibration.inter_busbw_efficiency, inter.latency
        ),
        all_to_all_bandwidth=base.all_to_all_bandwidth * calibration.inter_busbw_efficiency,
    )


# -- sourced defaults, one per GPU generation ---------------------------------------------------

ATTENTION_KERNELS: dict[str, dict[str, tuple[float, float, str]]] = {
    "h100-sxm": {
        # FlashAttention-3 (Shah et al. 2024, abstract): FA2 reaches 35% of H100 peak (and
        # tritonbench's H100 run in pytorch/pytorch#142132: FA2 329 TF/s at 4608 x 128).
        "fa2": (0.35, 1.25, "FlashAttention-2 on H100 (FA3 abstract: 35% of peak)"),
        # cuDNN's fused attention: what torch's SDPA runs on sm90 once the bundled cuDNN is
        # 9.15 or newer (sdp_utils' cuDNN-first order, torch 2.11; huggingface/transformers
        # #48163) and what Transformer Engine's DotProductAttention selects on Hopper (it drops
        # FlashAttention for FusedAttention there). Measured on one H100 SXM with torch 2.11
        # (data/calibration/h100-sxm-measured-raw.json, ``fit``: 0.4997 of peak, backward
        # 1.249x; 503 TF/s causal forward at 4K tokens, beyond FA2's reach).
        "cudnn": (0.50, 1.25, "cuDNN fused attention on H100, measured (torch 2.11 SDPA)"),
    },
}
"""Fused-attention kernels per GPU generation: ``(attention_efficiency,
attention_backward_slowdown, source)``. Which kernel a run launched is a property of its
software stack, so a fidelity row names it; ``with_attention_kernel`` applies one."""


DEFAULTS: dict[str, Calibration] = {
    "a100-80gb": Calibration(
        "a100-80gb",
        # Ampere cuBLAS fp16 GEMMs at Megatron sizes reach ~250-265 of 312 TF (0.80-0.85);
        # Calculon's A100 table gives 0.95/0.9/0.6/0.1 at >=128/16/1 MFLOP buckets (ref §5).
        matmul_efficiency=0.82,
        matmul_half_flops=2e9,
        # FlashAttention-2 (Dao 2023, abstract): 50-73% of the theoretical maximum on A100.
        attention_efficiency=0.60,
        memory_efficiency=0.80,  # ref §3 priors 0.70-0.84 (autoparallel .. MAD-Max)
        # NCCL's default 12 channels on Ampere (ref §3, NCCL tuning) of the A100's 108 SMs
        comm_sm_share=12 / 108,
        source="ref §3/§5 priors (Calculon A100 size table; MAD-Max 0.836 memory; 7 us floor)",
    ),
    "h100-sxm": Calibration(
        "h100-sxm",
        # The GEMM curve measured on one H100 SXM (bench/microbench_gpu.py --full, 27 bf16
        # cuBLAS shapes, data/calibration/h100-sxm-measured.json): Megatron layer shapes
        # (m = 4-8K tokens, n or k = 1-4K) run at 0.59-0.65 of peak, square 4-16K ones at
        # 0.71-0.76. The earlier prior (0.72 / 4 GFLOP, autoparallel's 0.70 and MAD-Max's
        # 0.705, ref §3) held only for the large square GEMMs and priced layer GEMMs ~7% fast.
        matmul_efficiency=0.67,
        matmul_half_flops=1.8e9,
        # FlashAttention-3 (Shah et al. 2024, abstract): FlashAttention-2 reaches only 35% of
        # H100 peak; FA3 75% (fp16 fwd). The default is that FA2 level (ATTENTION_KERNELS'
        # "fa2"), assumed for the 2023-24 dense H100 rows, whose kernel is not published; a
        # run on cuDNN's fused attention (TE on Hopper, torch >= 2.11 SDPA) names "cudnn".
        attention_efficiency=ATTENTION_KERNELS["h100-sxm"]["fa2"][0],
        # The same measurement's causal forward+backward runs at >= 4K tokens: the backward
        # takes 1.18-1.38x (median 1.25) of 2.5x the forward's time (_fit_attention).
        attention_backward_slowdown=ATTENTION_KERNELS["h100-sxm"]["fa2"][1],
        memory_efficiency=0.80,
        # NCCL's default 16 channels on Hopper (ref §3, NCCL tuning) of the H100 SXM's 132 SMs
        comm_sm_share=16 / 132,
        source="GEMM curve and attention backward measured on one H100 SXM "
        "(data/calibration/h100-sxm-measured-raw.json); FA2 attention level (FA3 abstract); "
        "memory ref §3 priors 0.70-0.84",
    ),
}


def with_attention_kernel(calibration: Calibration, kernel: str) -> Calibration:
    """``calibration`` with the attention level of ``kernel`` (``ATTENTION_KERNELS``)."""
    kernels = ATTENTION_KERNELS.get(calibration.name.split("+", 1)[0], {})
    if kernel not in kernels:
        raise ClusterConfigError(
            f"calibration {calibration.name!r}: no measured or sourced attention kernel "
            f"{kernel!r}; known here: {sorted(kernels) or 'none'}"
        )
    efficiency, slowdown, source = kernels[kernel]
    return replace(
        calibration,
        name=f"{calibration.name}+{kernel}-attention",
        attention_efficiency=efficiency,
        attention_backward_slowdown=slowdown,
        source=f"{calibration.source}; attention: {source}",
    )


def default_calibration(cluster: Cluster | str) -> Calibration:
    """The shipped calibration for a cluster's GPU generation (a neutral one if none)."""
    name = cluster if isinstance(cluster, str) else cluster.name
    base = name.split("+", 1)[0]
    if base in DEFAULTS:
        return DEFAULTS[base]
    c = get_cluster(cluster)
    return Calibration(
        base,
        matmul_efficiency=c.compute_efficiency,
        memory_efficiency=c.memory_efficiency,
        kernel_floor=c.kernel_floor,
        source=f"{base} catalogue efficiencies (no calibration shipped)",
    )


# -- fitting ------------------------------------------------------------------------------------


def fit(measurements: Mapping[str, object] | str | Path, cluster: Cluster | str | None = None):
    """Estimate a ``Calibration`` from microbenchmark measurements.

    Args:
      measurements: the dict (or a path to the JSON) ``bench/microbench_gpu.py`` writes:
        ``{"cluster": name, "matmul": [{"flops", "seconds", "dtype"}], "hbm": [{"bytes",
        "seconds"}], "collectives": [{"level", "busbw"}]}``; absent sections keep defaults.
      cluster: the cluster the numbers are relative to (default: the file's ``cluster``).
    Returns:
      the fitted ``Calibration``: GEMM curve by least squares on ``1/eff = (1 + F_half/F) /
      e_max`` (linear in ``1/F``), memory efficiency from the best large copies, bus bandwidth
      from the large-message median per link level.
    """
    data = _load(measurements)
    base = get_cluster(cluster or str(data.get("cluster", "cpu-test")))
    start = default_calibration(base)
    changes: dict[str, float] = {}
    changes.update(_fit_matmul(data.get("matmul", []), base))
    changes.update(_fit_attention(data.get("attention", []), base, data.get("attention_train", ())))
    changes.update(_fit_memory(data.get("hbm", []), base))
    changes.update(_fit_conv(data.get("conv", []), base))
    changes.update(_fit_links(data.get("collectives", []), base))
    src = f"fitted from {data.get('device', 'measurements')} ({data.get('date', 'undated')})"
    return replace(start, name=f"{base.name}-fit", source=src, **changes)


def _load(measurements: Mapping[str, object] | str | Path) -> Mapping[str, object]:
    if isinstance(measurements, Mapping):
        return measurements
    try:
        return json.loads(Path(measurements).read_text())
    except (OSError, ValueError) as exc:
        raise ClusterConfigError(f"cannot read measurements {measurements}: {exc}") from None


def _fit_matmul(rows, cluster: Cluster) -> dict[str, float]:
    pts = [(float(r["flops"]), gpu_seconds(r), str(r.get("dtype", "bf16"))) for r in rows]
    pts = [(f, s, d) for f, s, d in pts if f > 0 and s > 0]
    if len(pts) < 2:
        return {}
    inv_f = np.array([1.0 / f for f, _, _ in pts])
    inv_eff = np.array([s * cluster.peak(d) / f for f, s, d in pts])
    slope, intercept = np.polyfit(inv_f, inv_eff, 1)
    if intercept <= 0:  # every GEMM was floor-bound: no asymptote to read off
        return {}
    e_max = min(1.0, 1.0 / float(intercept))
    out = {"matmul_efficiency": e_max, "matmul_half_flops": max(0.0, float(slope) * e_max)}
    out["kernel_floor"] = min(s for _, s, _ in pts)
    return out


def gpu_seconds(row: Mapping[str, object]) -> float:
    """A row's GPU-side time: its CUDA-graph replay time where measured (the host's launch
    cost of an eager call is not the kernel's), else its plain time."""
    graph = row.get("graph_seconds")
    return float(graph) if graph else float(row["seconds"])


def _fit_attention(rows, cluster: Cluster, train_rows=()) -> dict[str, float]:
    """Median achieved fraction of peak over the fused-attention runs (causal FLOPs).

    Training rows (forward + backward, causal, sequences of 4K and longer, where a step's
    attention time goes) take precedence over forward-only rows: the planner prices training.
    """
    train = [
        float(r["fwd_bwd_flops"]) / (float(r["fwd_bwd_seconds"]) * cluster.peak("bf16"))
        for r in train_rows
        if r.get("causal") and int(r["seq"]) >= 4096 and float(r["fwd_bwd_seconds"]) > 0
    ]
    effs = train or [
        float(r["flops"]) / (float(r["seconds"]) * cluster.peak(str(r.get("dtype", "bf16"))))
        for r in rows
        if float(r["seconds"]) > 0
    ]
    out = {"attention_efficiency": min(1.0, statistics.median(effs))} if effs else {}
    long_causal = [r for r in train_rows if r.get("causal") and int(r["seq"]) >= 4096]
    slowdowns = [x for x in map(backward_slowdown, long_causal) if x > 0]
    if slowdowns:
        out["attention_backward_slowdown"] = min(4.0, max(1.0, statistics.median(slowdowns)))
    return out


def backward_slowdown(row: Mapping[str, object]) -> float:
    """A forward+backward attention run's backward time per FLOP over its forward's (0 where
    the row cannot say): the backward's ``attention_backward_slowdown``."""
    fwd_s, fwd_f = float(row["fwd_seconds"]), float(row["fwd_flops"])
    bwd_s = float(row["fwd_bwd_seconds"]) - fwd_s
    bwd_f = float(row["fwd_bwd_flops"]) - fwd_f
    if min(fwd_s, fwd_f, bwd_s, bwd_f) <= 0:
        return 0.0
    return (bwd_s / bwd_f) / (fwd_s / fwd_f)


def _fit_conv(rows, cluster: Cluster) -> dict[str, float]:
    """Median full-tile efficiency over the compute-bound convolutions: each row's achieved
    fraction of peak over its tile utilisation (``conv.tile_utilisation`` of its shape)."""
    from .conv import tile_utilisation

    effs = []
    for r in rows:
        seconds = gpu_seconds(r)
        used = tile_utilisation(int(r["out_channels"]), int(r["in_channels"]),
                                int(r["kernel"]) ** 2, int(r.get("groups", 1)))  # fmt: skip
        if seconds > 0 and used > 0 and r.get("compute_bound", True):
            effs.append(float(r["flops"]) / (seconds * cluster.peak(str(r["dtype"]))) / used)
    return {"conv_efficiency": min(1.0, statistics.median(effs))} if effs else {}


def _fit_memory(rows, cluster: Cluster) -> dict[str, float]:
    rates = sorted(float(r["bytes"]) / float(r["seconds"]) for r in rows if float(r["seconds"]) > 0)
    if not rates:
        return {}
    best = statistics.median(rates[len(rates) // 2 :])  # large copies: the upper half
    return {"memory_efficiency": min(1.0, best / cluster.hbm_bandwidth)}


def _fit_links(rows, cluster: Cluster) -> dict[str, float]:
    out: dict[str, float] = {}
    levels = {"intra-node": cluster.intra_node, "inter-node": cluster.inter_node}
    for level, link in levels.items():
        rates = sorted(float(r["busbw"]) for r in rows if r.get("level") == level)
        if rates:
            key = "intra_busbw_efficiency" if level == "intra-node" else "inter_busbw_efficiency"
            out[key] = min(2.0, statistics.median(rates[len(rates) // 2 :]) / link.bandwidth)
    return out


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration JSON (the ``Calibration.to_json`` format)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ClusterConfigError(f"cannot read calibration {path}: {exc}") from None
    known = {f.name for f in fields(Calibration)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ClusterConfigError(f"unknown calibration fields {unknown}; known: {sorted(known)}")
    return Calibration(**data)


__all__ = [
    "ATTENTION_KERNELS",
    "DEFAULTS",
    "Calibration",
    "apply",
    "backward_slowdown",
    "default_calibration",
    "fit",
    "gpu_seconds",
    "load_calibration",
    "with_attention_kernel",
]
