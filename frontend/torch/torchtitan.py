"""torchtitan's side of ``TitanConfig``: its own parsing and checks, its Llama 3 model, its plan.

Everything here goes through torchtitan's public modules (``torchtitan.config.ConfigManager``,
``torchtitan.distributed.ParallelDims``, ``torchtitan.models.llama3``): a configuration
shardplan emits is parsed by the same ``ConfigManager`` a ``torchrun -m torchtitan.train``
command line goes through, its degrees go through ``ParallelDims``' validation, and
``parallelize`` applies ``parallelize_llama`` to a model so the placements it makes can be
compared with the plan's (``placements``). torchtitan is imported lazily, only here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...ir import Graph, Sharding
from ...solver.titan_config import TitanConfig, TitanConfigError


def model_args(flavor: str) -> Any:
    """torchtitan's ``TransformerModelArgs`` of a Llama 3 flavor (``debugmodel``, ``8B``, ...)."""
    from torchtitan.models.llama3 import llama3_args

    if flavor not in llama3_args:
        raise TitanConfigError(
            f"unknown Llama 3 flavor {flavor!r}; torchtitan has {sorted(llama3_args)}"
        )
    return llama3_args[flavor]


def heads(flavor: str) -> tuple[int, int, int]:
    """(layers, heads, KV heads) of a flavor."""
    args = model_args(flavor)
    return args.n_layers, args.n_heads, args.n_kv_heads or args.n_heads


def build_model(flavor: str, device: str = "meta", dtype: torch.dtype | None = None) -> Any:
    """torchtitan's Llama 3 ``Transformer`` (on ``meta``: nothing is allocated)."""
    from torchtitan.models.llama3 import Transformer

    with torch.device(device):
        model = Transformer(model_args(flavor))
    return model.to(dtype) if dtype is not None else model


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss: cross-entropy of the fp32 logits over every token."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def capture_llama(flavor: str, batch: int, seq_len: int, mixed_precision: str = "bfloat16"):  # type: ignore[no-untyped-def]
    """Capture one training step of torchtitan's Llama 3 ``flavor`` on ``meta`` (tokens
    ``[batch, seq_len]`` as inputs and labels). ``mixed_precision="bfloat16"`` captures the
    model in bf16, the dtype FSDP2's mixed precision computes in (shardplan's memory model
    then counts bf16 states; ``docs/torchtitan.md``). Returns (graph, context)."""
    from .capture import capture

    dtype = torch.bfloat16 if mixed_precision == "bfloat16" else None
    model = build_model(flavor, dtype=dtype)
    tokens = torch.randint(0, model_args(flavor).vocab_size, (batch, seq_len), device="meta")
    return capture(model, tokens, loss_fn=cross_entropy, loss_inputs=(tokens,))


def job_config(config: TitanConfig) -> Any:
    """Parse ``config.overrides()`` with torchtitan's ``ConfigManager`` (its CLI path)."""
    from torchtitan.config import ConfigManager

    try:
        return ConfigManager().parse_args(config.overrides())
    except SystemExit as error:  # tyro exits on a bad override
        raise TitanConfigError(f"torchtitan refused {config.overrides()}: exit {error}") from None


def parallel_dims(job: Any, world_size: int) -> Any:
    """torchtitan's ``ParallelDims`` of a parsed job (its degree checks run here)."""
    from torchtitan.distributed import ParallelDims

    p = job.parallelism
    try:
        return ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
            etp=p.expert_tensor_parallel_degree,
            world_size=world_size,
        )
    except AssertionError as error:
        raise TitanConfigError(f"torchtitan's ParallelDims refused the degrees: {error}") from None


def check(config: TitanConfig, world_size: int) -> Any:
    """torchtitan's parsing, ``ParallelDims`` and its model/trainer preconditions (the
    sequence divisor, the head split, the pipeline's stages); returns the parsed JobConfig."""
    job = job_config(config)
    dims = parallel_dims(job, world_size)
    layers, n_heads, n_kv = heads(config.flavor)
    if job.training.seq_len % dims.seq_len_divisor:
        raise TitanConfigError(
            f"seq_len {job.training.seq_len} is not divisible by torchtitan's "
            f"seq_len_divisor {dims.seq_len_divisor} (tp x 2 cp)"
        )
    if dims.pp > 1:
        _check_stages(job, dims, layers)
    config.check(world_size, layers, n_heads, n_kv)
    return job


def _check_stages(job: Any, dims: Any, layers: int) -> None:
    """The stage split torchtitan's ``pipeline_llm`` makes (its own generator)."""
    from torchtitan.distributed.pipeline_parallel import (
        generate_llm_fqn_per_model_part,
        get_schedule_class,
    )

    schedule = get_schedule_class(job.parallelism.pipeline_parallel_schedule)
    single = schedule.__name__ in ("ScheduleGPipe", "Schedule1F1B")
    stages = dims.pp * (1 if single else 2)
    try:
        generate_llm_fqn_per_model_part(stages, layers, 0, 0)
    except ValueError as error:
        raise TitanConfigError(f"torchtitan's pipeline split refused: {error}") from None


def parallelize(config: TitanConfig, model: Any, world_size: int) -> Any:
    """``parallelize_llama`` on ``model`` with ``config`` (needs an initialised process group
    of ``world_size`` ranks: a fake one on CPU, see the tests). Pipelining is torchtitan's
    ``pipeline_llm`` and is not applied here."""
    from torchtitan.models.llama3 import parallelize_llama

    job = check(config, world_size)
    dims = parallel_dims(job, world_size)
    dims.build_mesh()
    return parallelize_llama(model, dims, job)


def placements(model: Any) -> dict[str, Sharding]:
    """Each DTensor parameter's layout in shardplan's terms on the ``TitanConfig.mesh()`` axes:
    torchtitan's ``fsdp`` mesh dim is ``dp_shard x cp`` (axes of size 1 left out)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    out = {}
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            out[_fqn(name)] = Sharding.replicated(param.dim())
            continue
        dims: list[list[str]] = [[] for _ in range(param.dim())]
        mesh = param.device_mesh
        for mesh_dim, placement in enumerate(param.placements):
            axes = _axes_of(mesh.mesh_dim_names[mesh_dim], mesh.size(mesh_dim))
            if isinstance(placement, Shard) or hasattr(placement, "split_factor"):
                dims[placement.dim].extend(axes)  # _StridedShard: FSDP2 under TP on one dim
            elif not isinstance(placement, (Replicate, Partial)):
                raise TitanConfigError(f"{name}: unknown placement {placement!r}")
        out[_fqn(name)] = Sharding(tuple(tuple(sorted(d)) for d in dims))
    return out


def _axes_of(mesh_dim_name: str, size: int) -> list[str]:
    if size == 1:
        return []
    if mesh_dim_name == "fsdp":
        return ["fsdp"]  # dp_shard x cp: resolved against the config by the caller
    return [mesh_dim_name]


def _fqn(name: str) -> str:
    """Strip the wrappers activation checkpointing adds to parameter names."""
    return name.replace("._checkpoint_wrapped_module", "").replace(
        "_checkpoint_wrapped_module.", ""
    )


def planned_placements(graph: Graph, config: TitanConfig) -> dict[str, Sharding]:
    """The plan's parameter layouts under ``config``'s strategy, in ``placements``' terms
    (``dp_shard``/``cp`` folded into ``fsdp``, axes sorted per dim)."""
    strategy = config.strategy()
    pins = strategy.pins(graph, config.mesh())
    out = {}
    for v in graph.inputs:
        if (
            v.name in pins
            and v.origin.path
            and "#" not in v.origin.path
            and v.role.name == "PARAMETER"
        ):
            dims = []
            for d in pins[v.name].dims:
                axes = {"fsdp" if a in ("dp_shard", "cp") else a for a in d}
                dims.append(tuple(sorted(axes)))
            out[v.origin.path] = Sharding(tuple(dims))
    return out
