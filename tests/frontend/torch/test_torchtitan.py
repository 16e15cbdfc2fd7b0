"""Plans out to torchtitan: emitted configurations pass torchtitan's own parsing and checks,
its ``parallelize_llama`` makes the placements the plan says, and a gloo step matches one
process's loss. torchtitan's Llama 3 debug model, captured once."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import shardplan as sp
import torch
from shardplan.api.torchtitan import evaluate_torchtitan
from shardplan.frontend.torch import torchtitan as tt
from shardplan.solver.titan_config import TitanConfig, TitanConfigError
from shardplan.solver.titan_search import search_torchtitan

pytestmark = pytest.mark.torch

HELPER = Path(__file__).with_name("titan_world.py")
BATCH, SEQ = 8, 64
HSDP = sp.strategies.ParallelStrategy(
    "hsdp-tp", tp="tp", dp=("rep", "dp"), shard_params=True, replicate=("rep",),
    sequence_parallel=True, fsdp_dim0=True,
)  # fmt: skip
CASES = {  # world size: (the plan's mesh, the strategy pinned, the torchtitan degrees expected)
    8: ({"dp": 4, "tp": 2}, sp.strategies.tp_fsdp("tp"), {"dp_shard": 4, "tp": 2}),
    16: ({"rep": 2, "dp": 2, "tp": 4}, HSDP, {"dp_replicate": 2, "dp_shard": 2, "tp": 4}),
}


@pytest.fixture(scope="module")
def debug_step():
    graph, _ = tt.capture_llama("debugmodel", BATCH, SEQ, mixed_precision="float32")
    return graph


def _emitted(graph, world: int) -> TitanConfig:  # type: ignore[no-untyped-def]
    mesh, strategy, _ = CASES[world]
    plan = sp.evaluate(graph, mesh=sp.Mesh(mesh, cluster="h100-sxm"), strategy=strategy).plan
    return plan.to_torchtitan(flavor="debugmodel", price=False).config


def _run(mode: str, spec: dict) -> dict:
    result = subprocess.run(
        [sys.executable, str(HELPER), mode, json.dumps(spec)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"{mode} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("world", sorted(CASES))
def test_emitted_config_passes_torchtitans_parsing_and_checks(debug_step, world: int) -> None:
    """The plan's axes map to torchtitan's degrees; ConfigManager parses the overrides back to
    the same values and ParallelDims accepts the degrees for this world size."""
    config = _emitted(debug_step, world)
    expected = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, **CASES[world][2]}
    assert config.degrees() == expected
    assert (config.local_batch_size, config.seq_len) == (BATCH // config.data_parallel, SEQ)
    assert config.mixed_precision_param == "float32"  # the plan priced an f32 step
    job = tt.check(config, world)
    assert job.parallelism.tensor_parallel_degree == config.tp
    assert job.parallelism.data_parallel_shard_degree == config.dp_shard
    assert job.parallelism.data_parallel_replicate_degree == config.dp_replicate
    assert job.training.local_batch_size == config.local_batch_size
    assert job.activation_checkpoint.mode == "none"
    dims = tt.parallel_dims(job, world)
    assert (dims.dp_shard, dims.tp, dims.fsdp_enabled, dims.tp_enabled) == (
        config.dp_shard, config.tp, True, True
    )  # fmt: skip
    with pytest.raises(TitanConfigError, match="ParallelDims"):
        tt.check(config, world * 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(CASES))
def test_parallelize_llama_makes_the_planned_placements(debug_step, world: int) -> None:
    """torchtitan's parallelize_llama, on a fake world of ``world`` ranks, shards every
    parameter over the same axes, dim by dim, as the plan's strategy pins it."""
    config = _emitted(debug_step, world)
    applied = _run("fake", {"overrides": config.overrides(), "flavor": "debugmodel"})
    planned = {k: str(v) for k, v in tt.planned_placements(debug_step, config).items()}
    assert set(applied) == set(planned)
    assert applied == planned
    assert applied["layers.0.attention.wq.weight"] == '[{"fsdp", "tp"}, {}]'  # sharded: yes


TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "multiple_of": 32}


@pytest.mark.slow
def test_gloo_fsdp_tp_step_matches_one_process() -> None:
    """The FSDP2 x TP configuration emitted for a plan of a tiny torchtitan Llama runs on 4
    gloo ranks and gives one process's loss (rtol 1e-4)."""
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(**TINY))
    with torch.no_grad():
        model.init_weights()
    tokens = torch.randint(0, TINY["vocab_size"], (4, 32))
    reference = tt.cross_entropy(model(tokens), tokens)
    with torch.device("meta"):
        meta_model = Transformer(TransformerModelArgs(**TINY))
    from shardplan.frontend.torch.capture import capture

    graph, _ = capture(meta_model, tokens.to("meta"), loss_fn=tt.cross_entropy,
                       loss_inputs=(tokens.to("meta"),))  # fmt: skip
    mesh = sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")
    plan = sp.evaluate(graph, mesh=mesh, strategy=sp.strategies.tp_fsdp("tp")).plan
    config = plan.to_torchtitan(flavor="debugmodel", price=False).config
    assert (config.dp_shard, config.tp, config.mixed_precision_param) == (2, 2, "float32")
    spec = {"overrides": config.overrides(), "flavor_args": TINY, "tokens": tokens.tolist()}
    result = _run("gloo", spec)
    torch.testing.assert_close(torch.tensor(result["loss"]), reference.detach(), rtol=1e-4, atol=0)


def test_evaluate_torchtitan_prices_an_override_list(debug_step) -> None:
    """An override list prices as its strategy does, and a batch that is not the graph's is
    refused with the numbers."""
    config = TitanConfig(dp_shard=4, tp=2, local_batch_size=2, seq_len=SEQ, ac_mode="full")
    by_flags = evaluate_torchtitan(debug_step, config.overrides())
    direct = sp.evaluate(debug_step, mesh=config.mesh(), strategy=config.strategy())
    assert by_flags.step_time == pytest.approx(direct.step_time)
    assert by_flags.plan.recompute
    assert set(by_flags.plan.recompute.values()) == {"full"}
    with pytest.raises(TitanConfigError, match="global batch of 16"):
        evaluate_torchtitan(debug_step, config.replace(local_batch_size=4))


def test_pipelined_fsdp_stages_hold_their_parameters_gathered(debug_step) -> None:
    """torchtitan under PP keeps each stage's FSDP parameters gathered for the step, with
    fp32 gradient accumulators of that size until the one reduction after the last backward:
    ``sp.evaluate`` of a pp 2 x dp_shard 4 configuration puts them in every stage's memory
    (it counted the sharded parameters only)."""
    config = TitanConfig(pp=2, dp_shard=4, local_batch_size=2, seq_len=SEQ,
                         mixed_precision_param="float32")  # fmt: skip
    plan = evaluate_torchtitan(debug_step, config).plan
    layers = {s.index: set(s.layers) for s in plan.pipeline.stages}
    held = dict.fromkeys(layers, 0.0)
    for v in debug_step.inputs:
        parts = v.origin.path.split(".")
        if v.role is sp.Role.PARAMETER and parts[0] == "layers":
            stage = next(s for s, ids in layers.items() if int(parts[1]) in ids)
            held[stage] += v.type.numel * (v.type.itemsize + 4)
    sharded = replace(config.strategy(), pp_gathered=False)  # FSDP's memory without PP's hold
    plain = sp.evaluate(debug_step, mesh=config.mesh(), strategy=sharded).plan
    for stage, other in zip(plan.pipeline.stages, plain.pipeline.stages, strict=True):
        assert held[stage.index] > 0
        assert stage.memory_bytes - other.memory_bytes >= held[stage.index]
    assert plan.step_time == pytest.approx(plain.step_time)  # the same layouts, priced alike


def test_zero1_plan_is_named_even_with_one_sharded_table(debug_step) -> None:
    """A plan that shards optimizer states and keeps the parameters whole (ZeRO-1/2) is
    emitted as FSDP and says so, also when one parameter (the embedding table) is sharded
    over the same axis: the note weighs parameter bytes (it looked for an axis no parameter
    used, so one sharded table hid the Llama-3-8B free plan's ZeRO-2)."""
    from shardplan.api.torchtitan import nearest_config

    zero1 = sp.strategies.ParallelStrategy("zero1", dp=("dp",), shard_states=True)
    plan = sp.evaluate(debug_step, mesh=sp.Mesh({"dp": 8}), strategy=zero1).plan
    table = next(v for v in debug_step.inputs if v.origin.path == "tok_embeddings.weight")
    assert plan.shardings[table.name].sharded_axes == frozenset()
    shardings = {**plan.shardings, table.name: sp.Sharding((("dp",), ()))}
    for case in (plan, replace(plan, shardings=shardings)):
        config, differences = nearest_config(case)
        assert config.dp_shard == 8
        assert any("ZeRO-1/2" in d for d in differences), differences


def test_to_torchtitan_reports_both_steps_and_round_trips(debug_step) -> None:
    """A plan made from a torchtitan configuration emits that configuration back, priced at
    the same modelled step (gap 0)."""
    config = TitanConfig(dp_replicate=2, dp_shard=2, tp=2, local_batch_size=2, seq_len=SEQ,
                         ac_mode="selective", mixed_precision_param="float32")  # fmt: skip
    plan = sp.evaluate(debug_step, mesh=config.mesh(), strategy=config.strategy()).plan
    emission = plan.to_torchtitan()
    assert emission.config == config
    assert emission.gap == pytest.approx(0.0, abs=1e-6)
    text = emission.report()
    assert "plan " in text
    assert "torchtitan " in text
    assert "--parallelism.tensor_parallel_degree 2" in text


def test_search_ranks_the_space_and_its_best_prices_close(debug_step) -> None:
    """Every ranked configuration is one torchtitan accepts, fitting ones first by step; the
    closed form of the best is within 25% of sp.evaluate's pinned solve of it."""
    layers, heads, kv = tt.heads("debugmodel")
    search = search_torchtitan(debug_step, 8, heads, kv)
    assert len(search.ranked) > 50
    assert all(not p.config.problems(8, layers, heads, kv) for p in search.ranked)
    fits = [p.fits for p in search.ranked]
    assert fits == sorted(fits, reverse=True)
    steps = [p.step_time for p in search.ranked if p.fits]
    assert steps == sorted(steps)
    best = search.best.config
    exact = sp.evaluate(debug_step, mesh=best.mesh(), strategy=best.strategy())
    assert abs(search.best.step_time / exact.step_time - 1) < 0.25


@pytest.mark.slow
def test_cli_emits_a_torchtitan_command(capsys) -> None:  # type: ignore[no-untyped-def]
    """``shardplan plan ... --emit torchtitan``: the report with both steps, the overrides that
    torchtitan's ConfigManager accepts, and a torchrun line."""
    from shardplan.cli import main

    target = str(Path(__file__).resolve().parents[3] / "examples" / "torchtitan_llama.py")
    argv = ["plan", f"{target}:make", "--mesh", "dp=2,tp=2", "--emit", "torchtitan",
            "--flavor", "debugmodel", "-q"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    overrides = next(x for x in out.splitlines() if x.startswith("overrides")).split()[1:]
    config = TitanConfig.from_overrides(overrides)
    assert config.world_size == 4
    tt.check(config, 4)
    assert "modelled step  plan" in out
    assert "torchrun --nnodes 1 --nproc_per_node 4 -m torchtitan.train" in out
