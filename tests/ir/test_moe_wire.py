"""DeepEP-style deduplicated dispatch (``ir.moe``): the expected ranks a token reaches, and the
bytes the expert all-to-all of a dispatch buffer moves (``wire_type``)."""

from __future__ import annotations

import itertools
import math

import pytest
from shardplan.ir import Mesh, Sharding, TensorType
from shardplan.ir.moe import distinct_ranks, wire_type


@pytest.mark.parametrize(("experts", "top_k", "ranks"), [(8, 2, 4), (16, 4, 4), (12, 3, 3),
                                                          (8, 2, 8), (6, 1, 3)])  # fmt: skip
def test_distinct_ranks_is_the_mean_over_every_routing(experts, top_k, ranks):
    """Every set of ``top_k`` distinct experts, equally likely: the mean number of ranks hit."""
    per = experts // ranks
    hits = [len({e // per for e in pick}) for pick in itertools.combinations(range(experts), top_k)]
    assert distinct_ranks(experts, top_k, ranks) == pytest.approx(sum(hits) / len(hits))


def test_distinct_ranks_of_the_published_runs():
    """Qwen3 (128 experts, top-8) on EP 8: a token reaches 5.34 ranks, so DeepEP sends 0.667 of
    the slots; one expert per rank (Mixtral on EP 8) or no split: nothing to deduplicate."""
    assert distinct_ranks(128, 8, 8) / 8 == pytest.approx(0.6674, abs=1e-4)
    assert distinct_ranks(8, 2, 8) == 2
    assert distinct_ranks(128, 8, 1) == 1


def test_wire_type_shrinks_the_slots_of_an_expert_all_to_all_only():
    mesh = Mesh({"dp": 2, "ep": 4})
    buffer_type = TensorType((16, 8, 40, 64), "bf16")  # [e, g, c, h]
    buffer = (16, 4, 2, 40)
    tokens = Sharding.of(None, ("dp", "ep"), None, None)  # g split: before the dispatch
    experts = Sharding.of("ep", "dp", None, None)  # e split over ep: after it
    moved = wire_type(buffer_type, buffer, tokens, experts, mesh)
    ratio = distinct_ranks(16, 4, 4) / 4
    assert moved.shape == (16, 8, round(40 * ratio), 64)
    assert wire_type(buffer_type, buffer, experts, tokens, mesh) == moved  # the combine
    # no change of the expert split (a gather of g), or no buffer: the whole type
    assert wire_type(buffer_type, buffer, tokens, Sharding.of(None, "dp", None, None), mesh) == (
        buffer_type
    )
    assert wire_type(buffer_type, None, tokens, experts, mesh) == buffer_type


def test_wire_type_of_the_matmul_view_stays_divisible_by_its_split():
    """``[e, g * c, h]``: the merged dim shrinks to a multiple of the axes splitting it."""
    mesh = Mesh({"dp": 2, "ep": 4})
    view = TensorType((16, 8 * 5, 64), "bf16")
    buffer = (16, 4, 1, 5)
    src, dst = Sharding.of(None, ("dp", "ep"), None), Sharding.of("ep", "dp", None)
    moved = wire_type(view, buffer, src, dst, mesh)
    assert moved.shape[1] % 8 == 0
    ratio = distinct_ranks(16, 4, 4) / 4
    assert abs(moved.shape[1] - 40 * ratio) <= 4
    assert math.prod(moved.shape) < math.prod(view.shape)
