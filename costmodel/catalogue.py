"""Built-in clusters, each number with its source.

Sources are the project's reference sheet (``reference/ground_truth_and_hardware.md``, "ref §3"
below) unless marked. "(derived)" means computed from cited numbers; "(assumption)" marks a prior
with no measurement behind it yet, to be calibrated.
"""

from __future__ import annotations

from dataclasses import replace

from .cluster import Cluster, IslandLevel, LinkLevel, peak_table, register_cluster

GB = 1e9
TB = 1e12
TFLOPS = 1e12

# NCCL Ring/Simple base latency 8.4 us (NCCL tuning.cc, as quoted in ref §3 "NCCL constants");
# across nodes we take the top of the quoted 6.6-14 us range (assumption: network hop on top).
NCCL_INTRA_LATENCY = 8.4e-6
NCCL_INTER_LATENCY = 14e-6
# Efficiency priors, ref §3 "Efficiency defaults": compute 0.70 (autoparallel; MAD-Max 0.705),
# memory 0.80 (autoparallel 0.70 .. MAD-Max 0.836), and autoparallel's 7 us kernel floor.
COMPUTE_EFFICIENCY = 0.70
MEMORY_EFFICIENCY = 0.80
GPU_KERNEL_FLOOR = 7e-6
# IB NDR 400 Gb/s (ConnectX-7) measured 46-49 GB/s per NIC (nccl-tests#290, #267; ref §3).
NDR_NIC_BUSBW = 48 * GB

H100_SXM = Cluster(
    name="h100-sxm",
    devices_per_node=8,  # DGX/HGX H100: 8 GPUs, 8 x 400G NICs (MLPerf system JSON; ref §3)
    peak_flops=peak_table(
        {
            "bf16": 989.4 * TFLOPS,  # dense, NVIDIA datasheet via ref §3
            "f16": 989.4 * TFLOPS,
            "f8e4m3": 1978.9 * TFLOPS,
            "f8e5m2": 1978.9 * TFLOPS,
            "i8": 1978.9 * TFLOPS,  # INT8 tensor = FP8 rate (NVIDIA datasheet; not on ref sheet)
            "tf32": 494.7 * TFLOPS,
            "f32": 66.9 * TFLOPS,  # FP32 non-tensor 67 TF (NVIDIA datasheet; ref lists FP64 tensor)
            "f64": 66.9 * TFLOPS,  # FP64 tensor
        }
    ),
    hbm_bandwidth=3.35 * TB,
    hbm_capacity=80 * 10**9,
    # 8xH100 NVSwitch ring busbw ~370 GB/s (S. Jeaugey, nccl-tests#212). NVLS all-reduce reaches
    # ~480 GB/s but only for all-reduce at >= hundreds of MB, so the ring number is the default.
    intra_node=LinkLevel("nvlink4-nvswitch", 370 * GB, NCCL_INTRA_LATENCY),
    inter_node=LinkLevel("ib-ndr-400g", NDR_NIC_BUSBW, NCCL_INTER_LATENCY),
    all_to_all_bandwidth=NDR_NIC_BUSBW,  # a2a across nodes: one NIC per GPU (nccl-tests#267)
    compute_efficiency=COMPUTE_EFFICIENCY,
    memory_efficiency=MEMORY_EFFICIENCY,
    kernel_floor=GPU_KERNEL_FLOOR,
    source="NVIDIA H100 SXM5 datasheet; nccl-tests#212/#267/#290; NCCL tuning.cc (ref §3)",
)

H200_SXM = Cluster(
    name="h200-sxm",
    devices_per_node=8,
    peak_flops=peak_table(
        {
            "bf16": 989 * TFLOPS,  # same Hopper die as H100 SXM (ref §3)
            "f16": 989 * TFLOPS,
            "f8e4m3": 1978.9 * TFLOPS,  # (derived) = H100 SXM, same die
            "f8e5m2": 1978.9 * TFLOPS,
            "i8": 1978.9 * TFLOPS,
            "tf32": 494.7 * TFLOPS,
            "f32": 66.9 * TFLOPS,
            "f64": 66.9 * TFLOPS,
        }
    ),
    hbm_bandwidth=4.8 * TB,  # 141 GB HBM3e at 4.8 TB/s (ref §3)
    hbm_capacity=141 * 10**9,
    # Same 900 GB/s NVLink4/NVSwitch as H100 (MLPerf H200 system JSON, ref §3), so we reuse the
    # H100 ring busbw (derived; not separately measured).
    intra_node=LinkLevel("nvlink4-nvswitch", 370 * GB, NCCL_INTRA_LATENCY),
    inter_node=LinkLevel("ib-ndr-400g", NDR_NIC_BUSBW, NCCL_INTER_LATENCY),
    all_to_all_bandwidth=NDR_NIC_BUSBW,
    compute_efficiency=COMPUTE_EFFICIENCY,
    memory_efficiency=MEMORY_EFFICIENCY,
    kernel_floor=GPU_KERNEL_FLOOR,
    source="ref §3 (H200 column); link numbers taken from H100 (same NVLink4 / NDR fabric)",
)

A100_80GB = Cluster(
    name="a100-80gb",
    devices_per_node=8,  # DGX A100: 8 GPUs, 8 x HDR 200 Gb/s NICs
    peak_flops=peak_table(
        {
            "bf16": 312 * TFLOPS,  # dense (ref §3)
            "f16": 312 * TFLOPS,
            "i8": 624 * TFLOPS,  # INT8 tensor (NVIDIA A100 datasheet; not on ref sheet)
            "tf32": 156 * TFLOPS,
            "f32": 19.5 * TFLOPS,  # FP32 non-tensor (NVIDIA datasheet); = FP64 tensor on ref sheet
            "f64": 19.5 * TFLOPS,
        }
    ),
    hbm_bandwidth=2.039 * TB,  # HBM2e (ref §3)
    hbm_capacity=80 * 10**9,
    # 8xA100 NVSwitch all-reduce busbw ~230 GB/s (nccl-tests#175, #149; ref §3).
    intra_node=LinkLevel("nvlink3-nvswitch", 230 * GB, NCCL_INTRA_LATENCY),
    # DGX-A100 8xHDR multi-node AR 192 GB/s => 24 GB/s per HDR NIC (derived; nccl#1576, #812).
    inter_node=LinkLevel("ib-hdr-200g", 24 * GB, NCCL_INTER_LATENCY),
    all_to_all_bandwidth=24 * GB,
    compute_efficiency=COMPUTE_EFFICIENCY,
    memory_efficiency=MEMORY_EFFICIENCY,
    kernel_floor=GPU_KERNEL_FLOOR,
    source="NVIDIA A100 datasheet; nccl-tests#175/#149; NVIDIA/nccl#1576 (ref §3)",
)

B200 = Cluster(
    name="b200",
    devices_per_node=8,  # HGX B200: 8 GPUs on NVSwitch 5
    peak_flops=peak_table(
        {
            # HGX B200 at 1,000 W, dense matrix rates (glennklockwood.com/garden/processors/B200,
            # citing NVIDIA; not on the ref sheet).
            "bf16": 2250 * TFLOPS,
            "f16": 2250 * TFLOPS,
            "f8e4m3": 4500 * TFLOPS,
            "f8e5m2": 4500 * TFLOPS,
            "i8": 4500 * TFLOPS,
            "tf32": 1100 * TFLOPS,
            "f32": 80 * TFLOPS,
            "f64": 40 * TFLOPS,
        }
    ),
    hbm_bandwidth=8.0 * TB,  # 8 TB/s HBM3e (same page)
    hbm_capacity=180 * 10**9,  # HGX B200 exposes ~179-180 GB of the 192 GB stacks
    # autoparallel's per-GPU intra-node bandwidth for B200, 640 GB/s (ref §3 "NCCL constants").
    intra_node=LinkLevel("nvlink5-nvswitch", 640 * GB, NCCL_INTRA_LATENCY),
    # Assumption: ConnectX-7 400G per GPU as on HGX H100 (800G CX-8 nodes would double this).
    inter_node=LinkLevel("ib-ndr-400g", NDR_NIC_BUSBW, NCCL_INTER_LATENCY),
    all_to_all_bandwidth=NDR_NIC_BUSBW,
    compute_efficiency=COMPUTE_EFFICIENCY,
    memory_efficiency=MEMORY_EFFICIENCY,
    kernel_floor=GPU_KERNEL_FLOOR,
    source="glennklockwood.com B200 page (NVIDIA HGX figures); autoparallel B200 link number",
)

TPU_V5P = Cluster(
    name="tpu-v5p",
    # The ICI domain is the "node": a v5p pod has 8,960 chips on one 3-D torus (ref §3);
    # jobs larger than one ICI slice talk over DCN.
    devices_per_node=8960,
    peak_flops=peak_table(
        {
            "bf16": 459 * TFLOPS,  # ref §3
            "i8": 918 * TFLOPS,  # (Cloud TPU v5p docs: int8 = 2x bf16; not on ref sheet)
            "f32": 459 * TFLOPS / 3,  # (assumption) f32 matmul as 3 bf16 passes (XLA default)
        }
    ),
    hbm_bandwidth=2.765 * TB,  # 95 GB HBM2e at 2,765 GB/s (ref §3)
    hbm_capacity=95 * 10**9,
    # ICI 1,200 GB/s bidirectional per chip over 6 torus links = 100 GB/s per link direction;
    # a bidirectional ring along one torus axis drains at 2 x 100 GB/s (derived, conservative
    # for groups that span several torus axes). Latency is an assumption.
    intra_node=LinkLevel("ici", 200 * GB, 5e-6),
    # DCN 50 Gb/s per chip = 6.25 GB/s (ref §3); latency an assumption.
    inter_node=LinkLevel("dcn", 6.25 * GB, 30e-6),
    all_to_all_bandwidth=6.25 * GB,
    nics_per_node=8960,
    compute_efficiency=COMPUTE_EFFICIENCY,
    memory_efficiency=MEMORY_EFFICIENCY,
    kernel_floor=2e-6,  # (assumption) TPU fuses aggressively; small per-op overhead
    source="Cloud TPU v5p docs (ref §3); ring bandwidth and latencies derived/assumed",
)

# Multi-island clusters (Pathways): the same devices, with islands joined by a DCN.
# H100: a DGX SuperPOD scalable unit is 32 DGX H100 nodes = 256 GPUs on one rail-optimised IB
# fabric (NVIDIA DGX SuperPOD H100 reference architecture, "Network Fabrics", Table 4). Between
# SUs/sites we take the DCN to be the nodes' north-south Ethernet: two ConnectX-7 ports bonded at
# up to 400 Gb/s each (DGX BasePOD deployment guide, "Network overview") = 100 GB/s per node =
# 12.5 GB/s per GPU line rate (derived); 80% of line rate for RoCE/TCP over a routed DCN
# (assumption) gives 10 GB/s per GPU. DCN latency 30 us (assumption, as TPU DCN below).
H100_DCN_PER_GPU = 10 * GB
H100_SUPERPOD_DCN = replace(
    H100_SXM,
    name="h100-superpod-dcn",
    islands=(IslandLevel(256, LinkLevel("dcn-ethernet", H100_DCN_PER_GPU, 30e-6)),),
    source="h100-sxm, islands of one DGX SuperPOD SU (256 GPUs, NVIDIA SuperPOD H100 RA) over "
    "the 2x400G north-south ConnectX-7 ports (DGX BasePOD guide); DCN efficiency/latency assumed",
)

# TPU v5p multislice: ICI inside a slice, DCN 50 Gb/s per chip = 6.25 GB/s between slices
# (ref §3). The "node" is one v5p host of 4 chips (Cloud TPU v5p docs), but hosts in a slice
# talk over ICI too, so inter_node is the ICI ring (4 hosts' worth of rings cap at ICI). Slice
# size 256 chips (a 4x8x8 v5p-512) is a representative choice, not a constant: set your own
# with ``cluster_from_dict({"base": "tpu-v5p-multislice", "islands": [{...}]})``.
TPU_V5P_MULTISLICE = replace(
    TPU_V5P,
    name="tpu-v5p-multislice",
    devices_per_node=4,
    inter_node=TPU_V5P.intra_node,
    nics_per_node=4,
    all_to_all_bandwidth=TPU_V5P.intra_node.bandwidth,
    islands=(IslandLevel(256, TPU_V5P.inter_node),),
    source="Cloud TPU v5p docs (ref §3): ICI in a 256-chip slice, DCN 50 Gb/s per chip across",
)

CPU_TEST = Cluster(
    name="cpu-test",
    # Round numbers for hand-computed tests: 4 devices per node, intra busbw 100 GB/s with 1 us
    # latency, 10 GB/s per NIC with 10 us latency, efficiencies 1 and no kernel floor.
    devices_per_node=4,
    peak_flops=peak_table({"f32": 1 * TFLOPS, "bf16": 2 * TFLOPS, "f16": 2 * TFLOPS}),
    hbm_bandwidth=100 * GB,
    hbm_capacity=16 * 10**9,
    intra_node=LinkLevel("test-intra", 100 * GB, 1e-6),
    inter_node=LinkLevel("test-inter", 10 * GB, 10e-6),
    all_to_all_bandwidth=10 * GB,
    compute_efficiency=1.0,
    memory_efficiency=1.0,
    kernel_floor=0.0,
    source="synthetic test cluster (round numbers, not real hardware)",
)

CLUSTERS: dict[str, Cluster] = {
    c.name: c
    for c in (
        H100_SXM, H200_SXM, A100_80GB, B200, TPU_V5P, CPU_TEST, H100_SUPERPOD_DCN,
        TPU_V5P_MULTISLICE,
    )
}  # fmt: skip
"""The built-in catalogue (a snapshot; ``get_cluster`` also sees user-registered clusters)."""

for _cluster in CLUSTERS.values():
    register_cluster(_cluster)
