"""Cluster descriptions: what one device computes and how fast devices talk, per link level."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from shardplan.ir.errors import ClusterConfigError, UnknownClusterError
from shardplan.ir.mesh import Mesh


@dataclass(frozen=True, slots=True)
class LinkLevel:
    """One level of the interconnect as the alpha-beta model sees it.

    ``bandwidth`` is an nccl-tests style *bus* bandwidth per device (bytes/s): the rate at which
    the ring term ``(n-1)/n * S`` drains, so measured busbw plugs in directly.
    """

    name: str
    bandwidth: float
    """Bus bandwidth per device in bytes/s."""
    latency: float
    """Alpha: fixed seconds per collective on this level."""

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ClusterConfigError(
                f"link {self.name!r} needs bandwidth > 0 and latency >= 0, "
                f"got bandwidth={self.bandwidth} latency={self.latency}"
            )


@dataclass(frozen=True, slots=True)
class IslandLevel:
    """A link level above the inter-node network: islands of ``devices`` devices joined by ``link``.

    Pathways-style jobs span several islands (superpods, TPU slices, sites) over a data-centre
    network (DCN). ``link.bandwidth`` is each device's share of the DCN (bytes/s); a collective
    crossing islands runs one sub-collective per in-island member side by side, each on its own
    share (``costmodel/collectives.py`` prices it hierarchically).
    """

    devices: int
    """Devices in one island at this level (a multiple of the level below)."""
    link: LinkLevel
    """The network joining islands: per-device bandwidth and its latency."""

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ClusterConfigError(f"island level {self.link.name!r}: devices must be >= 1")


@dataclass(frozen=True, slots=True)
class Cluster:
    """A homogeneous cluster: nodes of ``devices_per_node`` devices joined by a network.

    Invariants:
      - ``peak_flops`` is a sorted tuple of ``(dtype, FLOP/s)`` pairs (a dict is accepted and
        converted) so the cluster hashes and can key ``functools.lru_cache``;
      - efficiencies lie in (0, 1]; bandwidths are bytes/s; times are seconds.

    The inter-node level's ``bandwidth`` is per NIC (one NIC per device on DGX/HGX nodes). A ring
    collective whose group has ``k`` members in each node runs ``k`` rings side by side, one NIC
    each, so it drains at ``min(k * nic, intra busbw)`` (see ``costmodel/links.py``). An
    all-to-all across nodes gets no such aggregation: ``all_to_all_bandwidth`` per device.

    ``islands`` adds levels above the network (pods / slices / sites joined by a DCN); a
    cluster without them is the two-level cluster above, priced exactly as before.
    """

    name: str
    devices_per_node: int
    peak_flops: tuple[tuple[str, float], ...]
    """Dense peak FLOP/s per dtype (HLO dtype names, e.g. ``bf16``)."""
    hbm_bandwidth: float
    hbm_capacity: int
    """Bytes of device memory."""
    intra_node: LinkLevel
    inter_node: LinkLevel
    all_to_all_bandwidth: float
    """Per-device bytes/s for an all-to-all that crosses nodes (one NIC, no aggregation)."""
    nics_per_node: int = 0
    """NICs per node; 0 means one per device."""
    compute_efficiency: float = 0.70
    memory_efficiency: float = 0.80
    attention_efficiency: float = 0.0
    """Fraction of dense peak a fused (flash) attention kernel reaches on its causal FLOPs;
    0 means ``compute_efficiency`` (a kernel at GEMM efficiency, FlashAttention-3's level on
    Hopper). Calibrations of older runs set their kernel's (``costmodel.calibration``)."""
    attention_backward_slowdown: float = 1.0
    """Fused attention backward time over 2.5x its forward time (its FLOP ratio): > 1 where
    the backward kernel runs below the forward's efficiency (``costmodel.calibration``)."""
    conv_efficiency: float = 0.0
    """Fraction of dense peak a full-tile implicit-GEMM convolution reaches (cuDNN); 0 means
    ``compute_efficiency`` (a GEMM's). Tile quantisation comes on top (``costmodel/conv.py``).
    """
    nchw_convolutions: bool = False
    """Convolutions read and write NCHW (PyTorch's default contiguous format) while their
    kernels run NHWC: cuDNN's tensor-core implicit GEMMs take channels last, so each call
    transposes its NCHW activations in and its result out (``costmodel.conv.layout_bytes``).
    False: activations are channels last (``torch.channels_last``, XLA's layout assignment)."""
    kernel_floor: float = 0.0
    """Seconds: the least any non-empty kernel takes (launch + tail)."""
    engine: str = "eager"
    """How kernels are launched (``costmodel.engine``): ``eager``, ``cuda_graph`` or ``fused``."""
    source: str = ""
    notes: tuple[str, ...] = field(default=())
    islands: tuple[IslandLevel, ...] = ()
    """Link levels above ``inter_node``, innermost first (empty: one island, two levels)."""

    def __post_init__(self) -> None:
        flops = self.peak_flops  # a dict is accepted at runtime (files, users) and frozen here
        peaks = flops if isinstance(flops, Mapping) else dict(flops)
        object.__setattr__(self, "peak_flops", peak_table(peaks))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "islands", tuple(self.islands))
        below = self.devices_per_node
        for level in self.islands:
            if level.devices % below or level.devices <= below:
                raise ClusterConfigError(
                    f"cluster {self.name!r}: an island of {level.devices} devices must be a "
                    f"larger multiple of the level below ({below} devices)"
                )
            below = level.devices
        if self.nics_per_node == 0:
            object.__setattr__(self, "nics_per_node", self.devices_per_node)
        if self.devices_per_node < 1:
            raise ClusterConfigError(f"cluster {self.name!r}: devices_per_node must be >= 1")
        for name in ("compute_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ClusterConfigError(f"cluster {self.name!r}: {name}={value} is not in (0, 1]")
        if not 0 <= self.conv_efficiency <= 1:
            raise ClusterConfigError(
                f"cluster {self.name!r}: conv_efficiency={self.conv_efficiency} is not in "
                "(0, 1] (or 0 for compute_efficiency)"
            )
        if not 0 <= self.attention_efficiency <= 1:
            raise ClusterConfigError(
                f"cluster {self.name!r}: attention_efficiency={self.attention_efficiency} is "
                "not in (0, 1] (or 0 for compute_efficiency)"
            )
        if self.engine not in ("eager", "cuda_graph", "fused"):
            raise ClusterConfigError(
                f"cluster {self.name!r}: engine={self.engine!r} is not eager, cuda_graph or fused"
            )
        if not 1 <= self.attention_backward_slowdown <= 4:
            raise ClusterConfigError(
                f"cluster {self.name!r}: attention_backward_slowdown="
                f"{self.attention_backward_slowdown} is not in [1, 4]"
            )
        if not self.peak_flops:
            raise ClusterConfigError(f"cluster {self.name!r}: peak_flops needs one dtype at least")

    @property
    def fused_attention_efficiency(self) -> float:
        """``attention_efficiency``, or ``compute_efficiency`` where it is not set."""
        return self.attention_efficiency or self.compute_efficiency

    @property
    def levels(self) -> tuple[tuple[str, int | None, LinkLevel], ...]:
        """``(level, devices per domain, link)`` from the innermost level out.

        The domain size is how many consecutive devices share that level's link (``None`` for
        the outermost: the whole cluster). Level names are ``intra-node``, ``inter-node`` and
        ``inter-island`` (``inter-island-2`` ... for deeper island levels).
        """
        sizes = [self.devices_per_node] + [level.devices for level in self.islands]
        out: list[tuple[str, int | None, LinkLevel]] = [
            ("intra-node", sizes[0], self.intra_node),
            ("inter-node", sizes[1] if len(sizes) > 1 else None, self.inter_node),
        ]
        for i, level in enumerate(self.islands):
            size = sizes[i + 2] if i + 2 < len(sizes) else None
            out.append((island_level_name(i), size, level.link))
        return tuple(out)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; unknown dtypes fall back to the slowest listed one."""
        table = dict(self.peak_flops)
        if dtype in table:
            return table[dtype]
        return min(table.values())

    def __str__(self) -> str:
        return f"{self.name} ({self.devices_per_node} devices/node)"


def island_level_name(index: int) -> str:
    """``inter-island`` for the first island level, ``inter-island-2`` ... above it."""
    return "inter-island" if index == 0 else f"inter-island-{index + 1}"


_REGISTRY: dict[str, Cluster] = {}


def register_cluster(cluster: Cluster, *, overwrite: bool = True) -> Cluster:
    """Make ``cluster`` reachable by name (``Mesh(..., cluster=name)``)."""
    if not overwrite and cluster.name in _REGISTRY:
        raise ClusterConfigError(f"cluster {cluster.name!r} is already registered")
    _REGISTRY[cluster.name] = cluster
    return cluster


def get_cluster(name: str | Cluster) -> Cluster:
    """Look a cluster up by name (a ``Cluster`` passes through)."""
    if isinstance(name, Cluster):
        return name
    from . import catalogue  # noqa: F401  (registers the built-in clusters on first use)

    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownClusterError(
            f"unknown cluster {name!r}; known clusters: {known}. "
            "hint: describe your own with load_cluster(path) or register_cluster(Cluster(...)), "
            "or hand the object to the mesh: Mesh(axes, cluster=Cluster(...))"
        ) from None


def cluster_of(mesh: Mesh) -> Cluster:
    """The cluster ``mesh`` runs on: the object it holds (``Mesh(axes, cluster=Cluster(...))``,
    or one an entry point resolved), else its ``cluster`` name looked up in the catalogue. The
    one place below the entry points that reads a mesh's cluster."""
    held = mesh.hardware
    if held is not None:
        if not isinstance(held, Cluster):
            raise ClusterConfigError(
                f"mesh cluster {mesh.cluster!r} is a {type(held).__name__}, not a Cluster; "
                "pass Mesh(axes, cluster=Cluster(...)) or a catalogue name"
            )
        return held
    return get_cluster(mesh.cluster)


def known_clusters() -> tuple[str, ...]:
    from . import catalogue  # noqa: F401

    return tuple(sorted(_REGISTRY))


def tf32_matmuls(cluster: Cluster | str) -> Cluster:
    """``cluster`` with fp32 math at its TF32 tensor-core rate (``<name>+tf32``): a run with
    ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32`` (cuDNN's
    default for convolutions; NGC containers also turn it on for matmuls). The FLOP-bound
    kernels of an fp32 step are its GEMMs and convolutions; the rest are bandwidth-bound, so one
    fp32 rate is enough. A cluster without a ``tf32`` peak is refused."""
    base = get_cluster(cluster)
    peaks = dict(base.peak_flops)
    if "tf32" not in peaks:
        raise ClusterConfigError(
            f"cluster {base.name!r} lists no tf32 peak (it has {sorted(peaks)}); add one to "
            "its peak_flops to price fp32 math on TF32 tensor cores"
        )
    peaks["f32"] = peaks["tf32"]
    return replace(base, name=f"{base.name}+tf32", peak_flops=peak_table(peaks))


def nchw_convolutions(cluster: Cluster | str) -> Cluster:
    """``cluster`` running its convolutions on NCHW activations (``<name>+nchw``): a PyTorch
    run that never calls ``.to(memory_format=torch.channels_last)``, such as NVIDIA's ResNet-50
    TF32 recipe (``--memory-format`` defaults to ``nchw``; only its AMP config sets ``nhwc``).
    cuDNN converts each NCHW operand of a tensor-core convolution to NHWC and its result back
    (the transposes channels-last removes: MosaicML Composer's "Channels Last" method card,
    NVIDIA's "Tensor Layouts In Memory: NCHW vs NHWC"); ``costmodel.conv.layout_time`` prices
    them at HBM bandwidth."""
    base = get_cluster(cluster)
    return replace(base, name=f"{base.name}+nchw", nchw_convolutions=True)


def peak_table(peaks: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """``{"bf16": 989e12, ...}`` as the sorted pairs ``Cluster.peak_flops`` stores."""
    return tuple(sorted((str(k), float(v)) for k, v in peaks.items()))


def _link_from_dict(level: str, spec: Mapping[str, object]) -> LinkLevel:
    try:
        return LinkLevel(
            str(spec.get("name", level)),
            float(spec["bandwidth"]),  # type: ignore[arg-type]
            float(spec["latency"]),  # type: ignore[arg-type]
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ClusterConfigError(
            f"{level} needs numeric 'bandwidth' (bytes/s) and 'latency' (s): {exc!r}"
        ) from None


def _island_from_dict(spec: object, base: IslandLevel | None = None) -> IslandLevel:
    """``{"devices": 256, "bandwidth": 10e9, "latency": 30e-6, "name": "dcn"}`` (or a level);
    link fields left out come from ``base``, the base cluster's level at the same depth."""
    if isinstance(spec, IslandLevel):
        return spec
    if isinstance(spec, Mapping) and base is not None:
        link = base.link
        spec = {"name": link.name, "bandwidth": link.bandwidth, "latency": link.latency, **spec}
    if not isinstance(spec, Mapping) or "devices" not in spec:
        raise ClusterConfigError(
            f"an island level needs 'devices', 'bandwidth' (bytes/s per device) and 'latency' "
            f"(s), got {spec!r}"
        )
    try:
        devices = int(spec["devices"])  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise ClusterConfigError(f"island 'devices' must be an integer: {exc!r}") from None
    return IslandLevel(devices, _link_from_dict("island", {"name": "dcn", **spec}))


def cluster_from_dict(data: Mapping[str, object]) -> Cluster:
    """Build a cluster from plain data; ``base = "<name>"`` starts from a catalogued cluster."""
    data = dict(data)
    base_name = data.pop("base", None)
    for level in ("intra_node", "inter_node"):
        spec = data.get(level)
        if isinstance(spec, Mapping):
            data[level] = _link_from_dict(level, spec)
    if "islands" in data:
        specs = list(data["islands"])  # type: ignore[call-overload]
        inherited = get_cluster(str(base_name)).islands if base_name is not None else ()
        data["islands"] = tuple(
            _island_from_dict(spec, inherited[i] if i < len(inherited) else None)
            for i, spec in enumerate(specs)
        )
    known = {f.name for f in fields(Cluster)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ClusterConfigError(f"unknown cluster fields {unknown}; known fields: {sorted(known)}")
    try:
        if base_name is not None:
            return replace(get_cluster(str(base_name)), **data)  # type: ignore[arg-type]
        return Cluster(**data)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ClusterConfigError(f"bad cluster description: {exc}") from None


def load_cluster(path: str | Path, *, register: bool = True) -> Cluster:
    """Read a cluster from a ``.toml`` or ``.json`` file and (by default) register it.

    Example TOML::

        name = "my-h100"
        base = "h100-sxm"            # optional: start from a catalogued cluster
        devices_per_node = 8
        inter_node = { bandwidth = 24e9, latency = 20e-6 }
        # optional: islands of 64 devices joined by a DCN (per-device bytes/s)
        islands = [{ devices = 64, bandwidth = 10e9, latency = 30e-6 }]
    """
    path = Path(path)
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise ClusterConfigError(f"cannot read cluster file {path}: {exc}") from None
    cluster = cluster_from_dict(data)
    return register_cluster(cluster) if register else cluster
