"""NCCL's protocol latencies: what a small ring collective inside one node costs.

The catalogue's flat alpha (``NCCL_INTRA_LATENCY``, 8.4 us: the Ring/Simple *base* latency) is
the whole latency term of a collective on the ``eager`` clusters, the ones the training rows and
the plan digests are priced on. A decode step of a serving engine runs two all-reduces of a few
KB per layer per token, where that term is most of the time, and NCCL's own model of it grows
with the group: a ring all-reduce over ``n`` ranks takes ``nsteps = 2(n-1)`` steps (all-gather
and reduce-scatter ``n-1``), each paying the link's hardware latency for the protocol, and NCCL
picks, per call, the protocol with the least ``latency + bytes / bandwidth``:

    time(p) = base[p] + nsteps * hw_nvlink[p] + bus_bytes / (ring_busbw * bw_share[p])

with ``bus_bytes`` the ring's traffic per device (``2(n-1)/n * S`` for all-reduce,
``(n-1)/n * S`` for all-gather and reduce-scatter, ``S`` the full buffer). Constants, Ring
column, from NCCL ``src/graph/tuning.cc`` (ref §3 "NCCL constants"):

| protocol | base (us) | NVLink hw latency per step (us) | share of the ring bus bandwidth |
|----------|-----------|---------------------------------|---------------------------------|
| LL       | 6.6       | 0.6                             | 1/4 (all-reduce; 1/3 otherwise) |
| LL128    | 14.0      | 1.9                             | 0.92 (120 of 128 bytes payload) |
| Simple   | 8.4       | 3.4                             | 1                               |

So an 8 KB all-reduce over 8 NVLink ranks is LL at 6.6 + 14 x 0.6 = 15.0 us (the flat model
says 8.4 us), over 4 ranks 10.2 us; a 1 GB one stays Simple and bandwidth-bound. Used for
groups inside one node on clusters run by a serving engine (``Cluster.engine`` not ``eager``,
``costmodel.engine``); across nodes and islands the alpha-beta of ``collectives.py`` applies.
Not modelled: NVLS (its 25 us latency never wins on small messages), tree all-reduce inside a
node, TensorRT-LLM's custom one-shot/two-shot all-reduce kernels.
"""

from __future__ import annotations

RING_PROTOCOLS = {  # protocol: (base s, NVLink hw latency per step s, share of ring bus bw)
    "LL": (6.6e-6, 0.6e-6, 1 / 4),
    "LL128": (14.0e-6, 1.9e-6, 0.92),
    "Simple": (8.4e-6, 3.4e-6, 1.0),
}
"""NCCL ``tuning.cc`` Ring ``baseLat``, ``hwLat[NCCL_HW_NVLINK]`` and its bandwidth refinements
(LL: ``busBw / 4`` for all-reduce, ``/ 3`` for the others; LL128: ``busBw * 0.92``)."""

RING_KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def ring_steps(kind: str, n: int) -> int:
    """Ring steps of ``kind`` over ``n`` ranks (NCCL ``nsteps``)."""
    return 2 * (n - 1) if kind == "all-reduce" else n - 1


def ring_protocol_times(kind: str, full_bytes: float, n: int, bus_bandwidth: float) -> dict:
    """Seconds of ``kind`` under each protocol for a full buffer of ``full_bytes`` over ``n``
    ranks of one NVLink ring with bus bandwidth ``bus_bandwidth`` (bytes/s)."""
    steps = ring_steps(kind, n)
    bus_bytes = steps / n * full_bytes  # 2(n-1)/n * S or (n-1)/n * S
    out = {}
    for protocol, (base, hop, share) in RING_PROTOCOLS.items():
        if protocol == "LL" and kind != "all-reduce":
            share = 1 / 3
        out[protocol] = base + steps * hop + bus_bytes / (bus_bandwidth * share)
    return out


def ring_time(kind: str, full_bytes: float, n: int, bus_bandwidth: float) -> float:
    """The least of ``ring_protocol_times``: the protocol NCCL's tuner picks."""
    return min(ring_protocol_times(kind, full_bytes, n, bus_bandwidth).values())


__all__ = ["RING_KINDS", "RING_PROTOCOLS", "ring_protocol_times", "ring_steps", "ring_time"]
