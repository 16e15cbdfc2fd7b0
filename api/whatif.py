"""What-if sweeps (the MAD-Max use): how step time and the best plan move with the hardware.

``sp.whatif(graph_or_model, *args, mesh=..., vary={"link_bandwidth": [0.5, 1, 2, 4]})`` scales
one cluster parameter at a time, re-plans on the scaled cluster (or re-evaluates a fixed
``strategy``), simulates the step (``costmodel.simulate``) and reports a table and a plot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..costmodel.cluster import (
    Cluster,
    ClusterConfigError,
    IslandLevel,
    LinkLevel,
    cluster_of,
)
from ..costmodel.simulate import simulate
from ..ir import Graph, Mesh, Sharding, ShardplanError
from ..ir.errors import ArgumentError

PARAMETERS = (
    "link_bandwidth", "intra_bandwidth", "inter_bandwidth", "dcn_bandwidth", "hbm_capacity",
    "hbm_bandwidth", "flops",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class WhatIfRow:
    parameter: str
    factor: float
    step_time: float
    """Simulated seconds (times ``repeat``); ``inf`` when no plan fits."""
    compute_time: float
    exposed_comm_time: float
    peak_memory_bytes: int
    plan_changed: bool
    """The chosen layouts differ from the unscaled cluster's plan."""
    status: str = "ok"


@dataclass(frozen=True, slots=True)
class WhatIf:
    rows: tuple[WhatIfRow, ...]
    cluster: str
    repeat: int = 1

    def table(self) -> str:
        head = f"{'parameter':<16} {'x':>5} {'step ms':>10} {'compute':>9} {'exposed':>9} "
        head += f"{'mem GiB':>8}  plan"
        lines = [f"what-if on {self.cluster} (times x{self.repeat})", head, "-" * len(head)]
        for r in self.rows:
            plan = "changed" if r.plan_changed else "same"
            if r.status != "ok":
                lines.append(f"{r.parameter:<16} {r.factor:>5g} {r.status}")
                continue
            lines.append(
                f"{r.parameter:<16} {r.factor:>5g} {r.step_time * 1e3:>10.3f} "
                f"{r.compute_time * 1e3:>9.3f} {r.exposed_comm_time * 1e3:>9.3f} "
                f"{r.peak_memory_bytes / 2**30:>8.2f}  {plan}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | Path) -> Path:
        """Step time against each scale factor, one panel per parameter (PNG, Agg backend)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        params = list(dict.fromkeys(r.parameter for r in self.rows))
        fig, axes = plt.subplots(1, len(params), figsize=(4 * len(params), 3.2), squeeze=False)
        for ax, name in zip(axes[0], params, strict=True):
            rows = [r for r in self.rows if r.parameter == name and r.status == "ok"]
            xs, ys = [r.factor for r in rows], [r.step_time * 1e3 for r in rows]
            ax.plot(xs, ys, marker="o", label="step")
            ax.plot(xs, [r.exposed_comm_time * 1e3 for r in rows], marker=".", label="exposed comm")
            changed = [(r.factor, r.step_time * 1e3) for r in rows if r.plan_changed]
            if changed:
                ax.scatter(*zip(*changed, strict=True), s=80, facecolors="none", edgecolors="r",
                           label="plan changed")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"{name} (x)")
            ax.set_ylabel("ms")
            ax.legend(fontsize=7)
        fig.suptitle(f"what-if on {self.cluster}")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def scale_cluster(cluster: Cluster, parameter: str, factor: float) -> Cluster:
    """A copy of ``cluster`` with one hardware parameter multiplied by ``factor``."""
    if factor <= 0:
        raise ArgumentError(f"scale factors must be > 0, got {factor} for {parameter}")

    def link(level: LinkLevel) -> LinkLevel:
        return LinkLevel(level.name, level.bandwidth * factor, level.latency)

    islands = tuple(IslandLevel(i.devices, link(i.link)) for i in cluster.islands)
    match parameter:
        case "link_bandwidth":
            changes: dict[str, Any] = {
                "intra_node": link(cluster.intra_node), "inter_node": link(cluster.inter_node),
                "all_to_all_bandwidth": cluster.all_to_all_bandwidth * factor, "islands": islands,
            }  # fmt: skip
        case "dcn_bandwidth":
            if not cluster.islands:
                raise ClusterConfigError(
                    f"cluster {cluster.name!r} has no island levels, so no DCN to vary; use a "
                    "multi-island cluster (e.g. h100-superpod-dcn) or inter_bandwidth"
                )
            changes = {"islands": islands}
        case "intra_bandwidth":
            changes = {"intra_node": link(cluster.intra_node)}
        case "inter_bandwidth":
            changes = {
                "inter_node": link(cluster.inter_node),
                "all_to_all_bandwidth": cluster.all_to_all_bandwidth * factor,
            }
        case "hbm_capacity":
            changes = {"hbm_capacity": int(cluster.hbm_capacity * factor)}
        case "hbm_bandwidth":
            changes = {"hbm_bandwidth": cluster.hbm_bandwidth * factor}
        case "flops":
            changes = {"peak_flops": tuple((d, f * factor) for d, f in cluster.peak_flops)}
        case _:
            raise ArgumentError(f"cannot vary {parameter!r}; one of {PARAMETERS}")
    return replace(cluster, name=f"{cluster.name}*{parameter}={factor:g}", **changes)


def whatif(
    model_or_graph: Any,
    *example_args: Any,
    mesh: Mesh,
    vary: Mapping[str, Sequence[float]],
    strategy: Mapping[str, Sharding] | None = None,
    repeat: int = 1,
    time_limit: float = 30.0,
    plot: str | Path | None = None,
    **options: Any,
) -> WhatIf:
    """Re-plan (or re-evaluate ``strategy``) under scaled copies of ``mesh``'s cluster.

    Args:
      model_or_graph: an IR ``Graph``, a torch module or a JAX callable (as ``sp.plan``).
      example_args: example inputs for a model.
      mesh: the device mesh; its cluster is the unscaled baseline.
      vary: parameter -> scale factors, parameters from ``PARAMETERS``.
      strategy: value name / origin path -> sharding pins kept fixed at every point (a
        hand-written strategy); ``None`` re-plans freely.
      repeat: multiply times by this (a one-layer graph standing for ``repeat`` layers).
      plot: also write the PNG here.
    Returns:
      a ``WhatIf`` with ``.table()`` and ``.plot(path)``.
    """
    from .checks import check_whatif_call

    given = dict(mesh=mesh, vary=vary, strategy=strategy, repeat=repeat, time_limit=time_limit)
    checked = check_whatif_call(model_or_graph, given, options)
    mesh, repeat, time_limit = checked["mesh"], checked["repeat"], checked["time_limit"]
    graph = _graph(model_or_graph, example_args, options)
    base = cluster_of(mesh)
    baseline = _layouts(_plan(graph, mesh, strategy, time_limit))
    rows = []
    for parameter, factors in vary.items():
        for factor in factors:
            cluster = scale_cluster(base, parameter, float(factor))
            rows.append(_row(graph, mesh, cluster, parameter, float(factor), strategy,
                             time_limit, repeat, baseline))  # fmt: skip
    result = WhatIf(tuple(rows), base.name, repeat)
    if plot is not None:
        result.plot(plot)
    return result


def _row(graph, mesh, cluster, parameter, factor, strategy, time_limit, repeat, baseline):
    scaled = Mesh(mesh.axes, cluster=cluster)  # the mesh holds it: nothing is registered
    try:
        plan = _plan(graph, scaled, strategy, time_limit)
    except ShardplanError as exc:
        status = f"no plan: {str(exc).splitlines()[0][:60]}"
        return WhatIfRow(parameter, factor, float("inf"), 0.0, 0.0, 0, False, status)
    sim = simulate(plan)
    return WhatIfRow(
        parameter, factor, sim.step_time * repeat, sim.compute_time * repeat,
        sim.exposed_comm_time * repeat, plan.peak_memory_bytes,
        _layouts(plan) != baseline,
    )  # fmt: skip


def _plan(graph: Graph, mesh: Mesh, strategy, time_limit: float):
    from ..solver.planner import plan_graph

    return plan_graph(graph, mesh, pins=strategy, time_limit=time_limit)


def _layouts(plan) -> dict[str, Sharding]:
    return dict(plan.shardings)


def _graph(model_or_graph: Any, example_args: tuple, options: Mapping[str, Any]) -> Graph:
    from ..frontend import capture

    return capture(model_or_graph, *example_args, **options)[0]


__all__ = ["PARAMETERS", "WhatIf", "WhatIfRow", "scale_cluster", "whatif"]
