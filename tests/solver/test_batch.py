"""Batch factors: found on every op that touches the batch, and capping their split holds."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.ir import Role
from shardplan.ir.models import GPT_125M, LLAMA3_8B, training_step
from shardplan.solver.batch import batch_inputs, batch_marks, plan_batch_split
from shardplan.solver.planner import plan_graph


@pytest.mark.parametrize("config", [GPT_125M, LLAMA3_8B])
def test_batch_reaches_forward_backward_and_weight_gradients_but_no_state(config) -> None:
    graph = training_step(config, batch=4, layers=2, seq=128)
    marks = batch_marks(graph)
    assert {v.name for v in batch_inputs(graph)} >= {"batch_input_ids", "batch_labels"}
    assert not any(v.role is not Role.INPUT for v in graph.inputs if v in marks.dims)
    # every weight matmul (forward, input gradient, weight gradient) carries the batch
    dots = [i for i, op in enumerate(graph.ops) if op.kind in ("einsum", "dot_general", "matmul")]
    assert dots
    assert all(i in marks.factors for i in dots)
    # the optimizer update never does
    assert not any(i in marks.factors for i, op in enumerate(graph.ops) if op.kind == "adamw")


@pytest.mark.parametrize("cap", [1, 2, 4])
def test_capped_plan_never_splits_the_batch_wider_than_the_cap(cap: int) -> None:
    graph = training_step(GPT_125M, batch=8, layers=2, seq=256)
    plan = plan_graph(graph, sp.Mesh({"dp": 4}, cluster="h100-sxm"), batch_split_limit=cap)
    assert cap % plan_batch_split(plan) == 0


def test_capping_the_batch_split_reindexes_the_warm_start() -> None:
    """A warm start (axis search: the incumbent's index per node) must name the same strategy
    after the cap shortens the lists: an index into the old list crashed the 70B pp x dp x cp
    x tp plan (IndexError in dominance pruning) or silently hinted another strategy."""
    from shardplan.solver.batch import cap_batch_split
    from shardplan.solver.costs import build_space
    from shardplan.solver.space_passes import _capped_hints

    graph = training_step(GPT_125M, batch=8, layers=1, seq=128)
    mesh = sp.Mesh({"dp": 4, "tp": 2}, cluster="h100-sxm")
    space, reference = build_space(graph, mesh), build_space(graph, mesh)
    cap_batch_split(reference, 1)
    before = [list(options) for options in space.strategies]
    hints = {}  # per node: a strategy the cap removes where there is one, else the last
    for n, options in enumerate(before):
        gone = [i for i, s in enumerate(options) if s not in reference.strategies[n]]
        hints[n] = gone[-1] if gone else len(options) - 1
    capped = _capped_hints(space, hints, 1, lambda _name, fn, *args: fn(*args))
    shortened = [n for n, options in enumerate(space.strategies) if len(options) < len(before[n])]
    assert shortened  # the cap removed strategies, so old indexes would be wrong
    dropped = 0
    for n, index in hints.items():
        if n in capped:
            assert space.strategies[n][capped[n]] is before[n][index]
        else:
            dropped += 1
            assert before[n][index] not in space.strategies[n]
    assert dropped  # some hinted strategies split the batch over 4 devices


@pytest.mark.parametrize("cap", [1, 2, 4])
def test_micro_batch_check_agrees_with_the_batch_split_where_the_batch_is_never_merged(
    cap: int,
) -> None:
    # The IR builder keeps the batch a dim of its own: a plan runs on micro-batches of s
    # samples exactly when its batch split divides s (the rule before merged dims counted).
    from shardplan.solver.batch import microbatch_fits

    graph = training_step(GPT_125M, batch=8, layers=2, seq=256)
    plan = plan_graph(graph, sp.Mesh({"dp": 4}, cluster="h100-sxm"), batch_split_limit=cap)
    split = plan_batch_split(plan)
    for size in (1, 2, 4, 8):
        assert microbatch_fits(plan, size) == (size % split == 0)
    assert not microbatch_fits(plan, 3)  # no whole number of micro-batches


@pytest.mark.parametrize("cap", [1, 2, 4])
def test_micro_batch_sizes_leave_an_unmerged_batchs_strategies_as_the_cap_filter_did(
    cap: int,
) -> None:
    # Enumerating by micro-batch sizes (micro_rules) gives exactly the strategies the cap
    # filter keeps of the whole-batch enumeration when no dim merges the batch with another
    # factor: pipeline plans of IR-builder models do not change.
    from shardplan.solver.batch import cap_batch_split, micro_rules
    from shardplan.solver.costs import build_space

    graph = training_step(LLAMA3_8B, batch=8, layers=1, seq=128)
    mesh = sp.Mesh({"dp": 4, "tp": 2}, cluster="h100-sxm")
    rules = micro_rules(graph, cap)
    assert rules  # the batch factors are resized ...
    filtered, micro = build_space(graph, mesh), build_space(graph, mesh, rules=rules)
    cap_batch_split(filtered, cap)
    before = [list(options) for options in micro.strategies]
    cap_batch_split(micro, cap)
    ops = slice(len(graph.inputs), None)  # (the batch inputs' layouts are still filtered)
    assert micro.strategies[ops] == before[ops]  # ... and no op strategy is filtered out
    for a, b in zip(filtered.strategies, micro.strategies, strict=True):
        assert [(s.operands, s.results) for s in a] == [(s.operands, s.results) for s in b]
