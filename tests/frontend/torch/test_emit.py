"""Emitter: applied plans on simulated ranks match the plain module; collectives; known answers."""

from __future__ import annotations

import copy

import pytest
import shardplan as sp
import torch
from applied import check_numerics as _check_numerics
from applied import device_mesh as _mesh
from shardplan.frontend.torch import simulate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def llama_2x2(examples):  # type: ignore[no-untyped-def]
    """The small HF Llama and its plan on a (2, 2) mesh (planned once for this file)."""
    model, inputs = examples["hf_llama"].make(batch=4, layers=1)
    plan = sp.plan(
        model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"), time_limit=10
    )
    return plan, model, inputs


def test_apply_mlp_matches_plain_module_on_2x2(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=16, dim=32, hidden=256)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"))
    _check_numerics(plan, model, inputs)


def test_apply_llama_matches_plain_module_on_2x2(llama_2x2) -> None:  # type: ignore[no-untyped-def]
    _check_numerics(*llama_2x2)


def test_apply_megatron_hand_pins_match_plain_module(examples) -> None:  # type: ignore[no-untyped-def]
    """Pinned column -> row layouts (Megatron) run as planned and give the same gradients."""
    model, inputs = examples["torch_mlp"].make(batch=8, dim=32, hidden=128, bias=False)
    pins = {"fc1.weight": sp.Sharding.of("tp", None), "fc2.weight": sp.Sharding.of(None, "tp")}
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"), pins=pins)
    assert plan.to_placements()["fc1.weight"][1] == Shard(0)
    _check_numerics(plan, model, inputs)


def _megatron_mlp(examples):  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=8, dim=32, hidden=128)
    pins = {"fc1.weight": sp.Sharding.of("tp", None), "fc2.weight": sp.Sharding.of(None, "tp")}
    return (
        sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"), pins=pins),
        model,
        inputs,
    )


def _fsdp_mlp(examples):  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=1024, dim=32, hidden=64, bias=False)
    return (
        sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test")),
        model,
        inputs,
    )


def _tp_fsdp_mlp(examples):  # type: ignore[no-untyped-def]
    """2-D: Megatron column/row on tp, the other weight dim sharded over dp (TP x FSDP)."""
    model, inputs = examples["torch_mlp"].make(batch=8, dim=32, hidden=128, bias=False)
    pins = {"fc1.weight": sp.Sharding.of("tp", "dp"), "fc2.weight": sp.Sharding.of("dp", "tp")}
    return (
        sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"), pins=pins),
        model,
        inputs,
    )


CASES = {"mlp-megatron": _megatron_mlp, "mlp-fsdp": _fsdp_mlp, "mlp-tp-fsdp": _tp_fsdp_mlp}


@pytest.mark.parametrize("case", ["mlp-megatron", "mlp-fsdp", "mlp-tp-fsdp", "llama-2x2"])
def test_follow_plan_collective_counts_match_plan(case, examples, request) -> None:  # type: ignore[no-untyped-def]
    """Under follow_plan the collectives of fwd+bwd - kind, mesh axes and bytes - are the cost
    model's collectives for the plan's reshards, and numerics still match the plain module."""
    if case == "llama-2x2":
        plan, model, inputs = request.getfixturevalue("llama_2x2")
    else:
        plan, model, inputs = CASES[case](examples)
    applied = _check_numerics(plan, model, inputs, follow=True)
    planned = simulate.planned_collective_list(plan)
    assert applied.observed == planned, (
        f"observed:\n{simulate.collective_listing(applied.observed)}\n"
        f"planned (cost model):\n{simulate.collective_listing(planned)}\n"
        "deviations:\n  " + "\n  ".join(applied.deviations)
    )
    assert sum(applied.observed.values()) > 0


def test_known_answer_large_batch_is_data_parallel(examples) -> None:  # type: ignore[no-untyped-def]
    """A large batch through a small MLP: the batch is split over every axis, no TP styles."""
    model, inputs = examples["torch_mlp"].make(batch=4096, dim=32, hidden=64)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 4}, cluster="cpu-test"))
    context = plan.frontend_context
    assert plan.shardings[context.input_values[0]].dims[0] == ("dp",)
    parallel = plan.to_parallelize_plan()
    assert parallel.tp_axis is None
    assert not parallel.styles
    assert parallel.dp_axes == ("dp",)


def test_known_answer_tiny_batch_is_megatron(examples) -> None:  # type: ignore[no-untyped-def]
    """A tiny batch through a wide MLP: fc1 column-parallel, fc2 row-parallel."""
    model, inputs = examples["torch_mlp"].make(batch=4, dim=256, hidden=8192, bias=False)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"tp": 4}, cluster="cpu-test"))
    placements = plan.to_placements()
    assert placements["fc1.weight"] == (Shard(0),)
    assert placements["fc2.weight"] == (Shard(1),)
    parallel = plan.to_parallelize_plan()
    assert parallel.tp_axis == "tp"
    assert isinstance(parallel.styles["fc1"], ColwiseParallel)
    assert isinstance(parallel.styles["fc2"], RowwiseParallel)
    assert parallel.expressible


def test_to_placements_follow_mesh_axis_order(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=8, dim=32, hidden=128, bias=False)
    pins = {"fc1.weight": sp.Sharding.of("tp", "dp")}
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"), pins=pins)
    assert plan.to_placements()["fc1.weight"] == (Shard(1), Shard(0))


def test_to_parallelize_plan_llama_styles_collapse_layers(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["hf_llama"].make(batch=2, seq=8, hidden=256, layers=2)
    pins = {
        f"model.layers.{i}.mlp.{name}.weight": sp.Sharding.of(*spec)
        for i in range(2)
        for name, spec in (("up_proj", ("tp", None)), ("gate_proj", ("tp", None)),
                           ("down_proj", (None, "tp")))
    }  # fmt: skip
    pins["input_ids"] = sp.Sharding.of(None, None)
    plan = sp.plan(
        model, *inputs, mesh=sp.Mesh({"tp": 2}, cluster="cpu-test"), pins=pins, time_limit=10
    )
    styles = plan.to_parallelize_plan().styles
    assert isinstance(styles["model.layers.*.mlp.up_proj"], ColwiseParallel)
    assert isinstance(styles["model.layers.*.mlp.down_proj"], RowwiseParallel)


def test_apply_rejects_a_mismatched_mesh(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=8, dim=8, hidden=16)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"))
    simulate.simulated_world(4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with pytest.raises(sp.ShardplanError, match="does not match the plan mesh"):
        plan.apply(copy.deepcopy(model), mesh)


@pytest.mark.parametrize("follow", [False, True], ids=["apply", "follow_plan"])
def test_apply_llama_with_attention_split_by_heads(examples, follow) -> None:  # type: ignore[no-untyped-def]
    """Megatron attention on an HF Llama: q/k/v column-, o row-parallel over tp. The keys and
    values are DTensors split by heads when HF's ``DynamicCache`` concatenates them onto its
    empty ``torch.tensor([])``, which DTensor's ``cat`` cannot reshard; eager ``cat`` skips it,
    and so do ``apply`` and the follower."""
    model, inputs = examples["hf_llama"].make(batch=4, layers=1)
    attention = "model.layers.0.self_attn"
    pins = {f"{attention}.{n}_proj.weight": sp.Sharding.of("tp", None) for n in "qkv"}
    pins[f"{attention}.o_proj.weight"] = sp.Sharding.of(None, "tp")
    plan = sp.plan(
        model,
        *inputs,
        mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"),
        pins=pins,
        time_limit=10,
    )
    assert plan.to_placements()[f"{attention}.k_proj.weight"][1] == Shard(0)
    _check_numerics(plan, model, inputs, follow=follow)


def test_a_forward_that_raises_leaves_no_mode_behind(examples) -> None:  # type: ignore[no-untyped-def]
    """``apply`` enters its contexts (implicit replication, saved-tensor hooks) around the root
    forward; a forward that raises must leave them too, or every later torch call runs in them."""
    model, inputs = examples["torch_mlp"].make(batch=8, dim=8, hidden=16)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"))
    with simulate.local_ranks(plan.mesh.size):
        sharded = plan.apply(copy.deepcopy(model), _mesh(plan))
        with pytest.raises(RuntimeError):
            sharded(torch.ones(8, 5))  # wrong feature size
    plain = torch.ones(2, 2)
    simulate.simulated_world(4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with simulate.local_ranks(4):
        replicated = torch.distributed.tensor.distribute_tensor(plain, mesh, src_data_rank=None)
        with pytest.raises(RuntimeError, match=r"mixed torch\.Tensor and DTensor"):
            replicated * plain  # implicit replication is off again


def test_redistribute_keeps_a_replicated_dim_where_the_plan_has_a_pending_sum() -> None:
    """DTensor cannot move R (or S) to P (the logical tensor would not change), so the emitter's
    boundary reshard keeps that dim as it is instead of raising."""
    from shardplan.frontend.torch.emit import redistribute
    from torch.distributed.tensor import Partial, Replicate

    simulate.simulated_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with simulate.local_ranks(4):
        x = torch.distributed.tensor.distribute_tensor(
            torch.ones(4, 4), mesh, [Replicate(), Shard(0)], src_data_rank=None
        )
        moved = redistribute(x, (Partial(), Replicate()))
        assert tuple(moved.placements) == (Replicate(), Replicate())
        torch.testing.assert_close(simulate.rank0(moved.full_tensor()), torch.ones(4, 4))


@pytest.fixture(scope="module")
def cohere():  # type: ignore[no-untyped-def]
    """HF Cohere (a family no other test uses) and its inputs."""
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    config = CohereConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    model = CohereForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 128, (8, 8))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "follow"),
    [("free", False), ("free", True), ("tp_fsdp", False)],
    ids=["free-apply", "free-follow_plan", "tp_fsdp-apply"],
)
def test_apply_cohere_on_a_3d_mesh_matches_plain_model(cohere, kind, follow) -> None:  # type: ignore[no-untyped-def]
    """Cohere on (2, 2, 2): its rotary (``torch.stack`` of interleaved halves) lowers without
    an unknown op. Under ``apply`` alone its attention meets operands DTensor's own path could
    not run: q and k replicated while v's heads stay split over two mesh dims (free plan:
    "_StridedShard redistribute assumes no flattened transforms"), v a pending sum over dp
    (TP x FSDP: a strategy search of minutes); the emitter runs both on the shared split.
    Under ``follow_plan`` every op runs at its planned layouts."""
    import warnings

    model, batch = cohere
    mesh = sp.Mesh({"dp": 2, "fsdp": 2, "tp": 2}, cluster="cpu-test")
    with warnings.catch_warnings():
        warnings.simplefilter("error", sp.UnsupportedOpWarning)
        if kind == "free":
            plan = sp.plan(model, batch, mesh=mesh)
        else:
            plan = sp.evaluate(model, batch, mesh=mesh, strategy=sp.strategies.tp_fsdp("tp")).plan
    _check_numerics(plan, model, (batch,), follow=follow)


def test_batched_matmul_with_heads_split_over_two_mesh_dims() -> None:
    """``q @ k^T`` with heads split over ``(fsdp, tp)`` (HF GPT-J's eager attention under a
    free plan on (2, 2, 2)): DTensor folds batch and heads into a ``_StridedShard`` and cannot
    unfold the product ("Sharding propagation failed for aten._unsafe_view"); ``apply``'s mode
    runs it on local shards, split as the operands are. Values and gradients are the plain
    product's."""
    from shardplan.frontend.torch.emit import _ApplyMode
    from torch.distributed.tensor import Replicate, distribute_tensor

    simulate.simulated_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "fsdp", "tp"))
    torch.manual_seed(0)
    q, k = (torch.randn(8, 8, 8, 4, requires_grad=True) for _ in range(2))
    heads = [Replicate(), Shard(1), Shard(1)]
    with simulate.local_ranks(8):
        dq, dk = (
            distribute_tensor(t.detach(), mesh, heads, src_data_rank=None).requires_grad_()
            for t in (q, k)
        )
        with _ApplyMode():
            out = torch.matmul(dq, dk.transpose(-1, -2))
        assert tuple(out.placements) == tuple(heads)
        out.sum().backward()
        got, grad_q = (simulate.rank0(t.full_tensor()) for t in (out, dq.grad))
    want = q @ k.transpose(-1, -2)
    want.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad_q, q.grad)


class _Tiler(torch.nn.Module):
    """``repeat`` between two linears: tiles the features (a dim a plan may split) and adds a
    leading dim, then folds it back."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiled = self.up(x).repeat(2, 1, 3)  # [b, 16] -> [2, b, 48]
        return self.down(tiled).sum(0)


@pytest.mark.parametrize("follow", [False, True], ids=["apply", "follow_plan"])
def test_repeat_lowers_and_runs_as_planned(follow) -> None:  # type: ignore[no-untyped-def]
    """``aten.repeat`` lowers to a broadcast then a reshape (it ran replicated, with an
    ``UnsupportedOpWarning``): its operand split as planned, every op at its planned layouts
    gives the plain gradients."""
    import warnings

    from shardplan.frontend.torch.capture import capture

    torch.manual_seed(0)
    model, x = _Tiler(), torch.randn(64, 8)
    pins = {"up.weight": sp.Sharding.of("tp", None)}  # the tiled features split over tp
    with warnings.catch_warnings():
        warnings.simplefilter("error", sp.UnsupportedOpWarning)
        graph, _ = capture(model, x)
        plan = sp.plan(model, x, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"), pins=pins)
    kinds = [op.kind for op in graph.ops]
    tiled = [op.results[0].type.shape for op in graph.ops if op.kind == "broadcast_in_dim"]
    assert (2, 64, 3, 16) in tiled  # [new, b, copies, features]: copies major, as repeat tiles
    assert not [k for k in kinds if k.startswith("aten.")]  # no op left unlowered
    applied = _check_numerics(plan, model, (x,), follow=follow)
    assert not applied.deviations


def _hf_family(family: str, attn: str):  # type: ignore[no-untyped-def]
    """A one-layer HF causal LM of ``family`` (hidden 64, 8 heads, vocab 128, no dropout) with
    attention implementation ``attn``, and a batch of (8, 8) ids with labels."""
    import transformers as tf

    torch.manual_seed(0)
    common = {"vocab_size": 128, "n_embd": 64, "n_layer": 1, "n_head": 8, "n_positions": 64,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # fmt: skip
    if family == "gptj":  # rotary on the first 4 of each head's 8 dims
        model = tf.GPTJForCausalLM(tf.GPTJConfig(rotary_dim=4, **common))
    elif family == "gpt_bigcode":  # multi-query attention: one key/value head
        model = tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(multi_query=True, **common))
    else:
        config = tf.OPTConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
            ffn_dim=128, max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
        )  # fmt: skip
        model = tf.OPTForCausalLM(config)
    model.config._attn_implementation = attn
    ids = torch.randint(0, 128, (8, 8))
    return model, {"input_ids": ids, "labels": ids}


_HF_MESHES = {"2x2x2": {"dp": 2, "fsdp": 2, "tp": 2}, "2x4": {"dp": 2, "tp": 4}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "gptj-eager-2x2x2-free", "gptj-eager-2x2x2-tp_fsdp", "gpt_bigcode-sdpa-2x2x2-free",
        "gpt_bigcode-sdpa-2x2x2-tp_fsdp", "opt-sdpa-2x4-free", "opt-sdpa-2x4-megatron",
    ],
)  # fmt: skip
def test_apply_more_hf_families_matches_plain_model(case) -> None:  # type: ignore[no-untyped-def]
    """GPT-J, GPT-BigCode and OPT (families no other test uses) applied as planned: loss and
    every gradient equal to the plain model's, and every op lowered. Before, each failed: GPT-J's
    ``repeat`` had no lowering and its eager ``q @ k^T`` went through DTensor's batched matmul
    ("Cannot unflatten tensor with _StridedShard placement"; under TP x FSDP a strategy search
    of one to three minutes); GPT-BigCode's multi-query attention on replicated q, k and v,
    left to DTensor, failed in backward ("_StridedShard redistribute assumes no flattened
    transforms"); a vocabulary-split lookup's ``_MaskPartial`` met a planned pending sum ("Can
    not redistribute from MaskP(sum, ...) to P(sum)"); OPT's linear backward got a gradient
    whose local shard was not contiguous ("view size is not compatible")."""
    import warnings

    family, attn, mesh_name, kind = case.split("-")
    model, batch = _hf_family(family, attn)
    mesh = sp.Mesh(_HF_MESHES[mesh_name], cluster="cpu-test")
    with warnings.catch_warnings():
        warnings.simplefilter("error", sp.UnsupportedOpWarning)
        if kind == "free":
            plan = sp.plan(model, batch, mesh=mesh)
        else:
            strategy = getattr(sp.strategies, kind)("tp")
            plan = sp.evaluate(model, batch, mesh=mesh, strategy=strategy).plan
        _check_numerics(plan, model, (batch,))


def test_prefer_throughput_plan_applies_as_data_parallel(examples) -> None:  # type: ignore[no-untyped-def]
    """A tiny MLP on 4 H100s: the free plan repeats the whole step on every device (and says
    so); ``prefer="throughput"`` splits the batch over both axes, and applied on simulated
    ranks it gives the plain module's loss and gradients, reducing the gradients over dp×tp
    (a reduce-scatter or all-reduce per gradient) as data parallelism does."""
    from shardplan.solver.summary import batch_axes

    model, inputs = examples["torch_mlp"].make(batch=16, dim=32, hidden=64)
    mesh = sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")
    with pytest.warns(sp.IdleDevicesWarning, match="4 devices repeat the same work"):
        free = sp.plan(model, *inputs, mesh=mesh, time_limit=10)
    assert not batch_axes(free)
    plan = sp.plan(model, *inputs, mesh=mesh, time_limit=10, prefer="throughput")
    assert batch_axes(plan) == ["dp", "tp"]
    assert plan.idle.free.step == free.step_time
    assert plan.idle.split.step == plan.step_time
    applied = _check_numerics(plan, model, inputs)
    reductions = ("all-reduce", "reduce-scatter")
    reduced = [n for (kind, axes, _), n in applied.observed.items()
               if kind in reductions and axes == ("dp", "tp")]  # fmt: skip
    params = len(list(model.parameters()))
    assert sum(reduced) == params, simulate.collective_listing(applied.observed)
