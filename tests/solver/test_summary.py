"""``print(plan)``: the one-screen summary (strategy in words, alike layers folded, costliest
reshards grouped), checked on hand-built plans whose strategy is known."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from shardplan import Sharding
from shardplan.costmodel.collectives import Collective
from shardplan.ir import Graph, Mesh, Origin, Role, TensorType
from shardplan.solver.plan import Plan, Reshard, SolverStats
from shardplan.solver.summary import index_ranges, layout_rows, reshard_groups, strategy_words

MESH = Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")


def _megatron_plan() -> Plan:
    """The hand-built Megatron plan of test_serialize.py (loaded by path: tests are no package)."""
    path = Path(__file__).with_name("test_serialize.py")
    spec = importlib.util.spec_from_file_location("_serialize_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_plan()


def _layered_plan(param: dict[int, Sharding], state: Sharding, batch: Sharding) -> Plan:
    """``layers.i.w`` (one per key of ``param``) with Adam-like ``#exp_avg`` states, a batch
    input read by one op per layer, and one all-gather per layer of 1 KiB."""
    g = Graph(name="stack")
    x = g.add_input("x", TensorType((8, 64), "f32"), Role.INPUT, Origin(path="batch['x']"))
    shardings = {"x": Sharding.of(None, None)}
    operands, reshards = {}, []
    for i, layout in param.items():
        w = g.add_input(f"w{i}", TensorType((64, 64), "f32"), Role.PARAMETER,
                        Origin(path=f"layers.{i}.w"))  # fmt: skip
        m = g.add_input(f"m{i}", TensorType((64, 64), "f32"), Role.OPTIMIZER_STATE,
                        Origin(path=f"layers.{i}.w#exp_avg"))  # fmt: skip
        op = g.add_op("dot", [x, w], [TensorType((8, 64), "f32")], names=[f"h{i}"],
                      origin=Origin(module=f"layers.{i}.proj"))  # fmt: skip
        shardings.update({w.name: layout, m.name: state, op.result.name: batch})
        operands[(len(g.ops) - 1, 0)] = batch
        operands[(len(g.ops) - 1, 1)] = Sharding.of(None, None)
        gather = Collective(
            "all-gather", tuple(a for axes in layout.dims for a in axes), 1024, 1e-6
        )
        reshards.append(Reshard(w.name, f"op:{len(g.ops) - 1}:1", layout, Sharding.of(None, None),
                                (gather,)))  # fmt: skip
    g.set_outputs([g.ops[-1].result])
    return Plan(
        graph=g, mesh=MESH, shardings=shardings, operand_shardings=operands, reshards=reshards,
        compute_time=1e-3, comm_time=4e-6, peak_memory_bytes=2**20, memory={"parameters": 2**16},
        solver=SolverStats("OPTIMAL", 1e-3, 1e-3, 0.1, 10, 2),
    )  # fmt: skip


def test_megatron_plan_in_words():
    """Batch rows on dp, both weights split on tp (not a batch axis): tensor parallelism."""
    words = strategy_words(_megatron_plan())
    assert (
        words == "batch over dp, tensor parallel over tp (100% of parameter bytes), recompute none"
    )


def test_fsdp_and_zero_in_words():
    """Weights split over the batch axis are FSDP-style; replicated weights whose optimizer
    states are split make a ZeRO-style update."""
    dp = Sharding.of("dp", None)
    fsdp = _layered_plan({0: dp, 1: dp}, dp, Sharding.of("dp", None))
    assert strategy_words(fsdp) == (
        "batch over dp, parameters sharded over dp (FSDP-style, 100% of bytes), recompute none, "
        "tp idle (splits nothing)"
    )
    whole = Sharding.of(None, None)
    zero = _layered_plan({0: whole, 1: whole}, Sharding.of(("dp", "tp"), None),
                         Sharding.of(("dp", "tp"), None))  # fmt: skip
    assert strategy_words(zero) == (
        "batch over dp×tp, parameters replicated, ZeRO-style sharded update over dp×tp, "
        "recompute none"
    )
    zero = dataclasses.replace(zero, recompute={"layers.0": "full", "layers.1": "full"})
    assert strategy_words(zero).endswith("recompute full on 2 layers")


def test_alike_layers_fold_into_one_row_per_layout():
    """Layers 0-2 and 4 share a layout and fold; layer 3 differs and keeps its own row."""
    dp, tp = Sharding.of("dp", None), Sharding.of(None, "tp")
    plan = _layered_plan({0: dp, 1: dp, 2: dp, 3: tp, 4: dp}, dp, dp)
    rows = layout_rows(plan)
    assert [(r.name, r.layout, r.update) for r in rows] == [
        ("layers.0-2,4.w ×4", '[{"dp"}, {}]', '[{"dp"}, {}]'),
        ("layers.3.w", '[{}, {"tp"}]', '[{"dp"}, {}]'),
    ]
    assert index_ranges([7, 0, 1, 2, 5]) == "0-2,5,7"


def test_reshards_of_alike_layers_group_and_sort_by_time():
    dp, tp = Sharding.of("dp", None), Sharding.of(None, "tp")
    plan = _layered_plan({0: dp, 1: dp, 2: dp, 3: tp}, dp, dp)
    groups = reshard_groups(plan)
    assert [(g.where, g.count, round(g.time * 1e6)) for g in groups] == [
        ("layers.*.proj", 3, 3),
        ("layers.*.proj", 1, 1),
    ]
    text = str(plan)
    assert "3 µs ×3    all-gather[dp] 1 KiB: %w0 -> dot in layers.*.proj" in text


def test_summary_of_the_megatron_plan():
    """Every part of the summary, on one screen, without the per-value tables."""
    text = str(_megatron_plan())
    lines = text.splitlines()
    assert len(lines) <= 40
    assert max(len(line) for line in lines) <= 110
    assert "42.5 µs modelled (compute 30 µs, communication 12.5 µs)" in text
    assert "80 KiB peak (activations 64 KiB, parameters 16 KiB)" in text
    assert "strategy       batch over dp, tensor parallel over tp" in text
    assert "fc1.weight  bf16[64,256]  [{}, {tp}]" in text
    assert "12.5 µs ×1    all-reduce[tp] 512 B: %out -> output 0" in text
    assert "Inputs" not in text
    assert "+---+" not in text


def test_mixed_fsdp_and_zero_give_their_shares():
    """One weight split like its state (FSDP), one replicated with a split state (ZeRO)."""
    dp, whole = Sharding.of("dp", None), Sharding.of(None, None)
    plan = _layered_plan({0: dp, 1: whole}, dp, dp)
    assert strategy_words(plan) == (
        "batch over dp, parameters sharded over dp (FSDP-style, 50% of bytes), "
        "ZeRO-style sharded update over dp (50% of optimizer-state bytes), recompute none, "
        "tp idle (splits nothing)"
    )
