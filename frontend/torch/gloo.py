"""Run a ParallelizePlan (FSDP2 / TP styles) or a pipeline on gloo processes; collect results.

FSDP2 cannot run under ``LocalTensorMode``, so its numerics are checked with one process per
rank. Spawned children rebuild the model from a factory given as ``"path/to/file.py:make"``
(models defined in scripts cannot be pickled), apply the plan, run one forward and backward on
their slice of the batch and rank 0 saves the loss (averaged over ranks) and full gradients.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from .train import step_loss


def load_factory(factory: str) -> Any:
    """``"examples/torch_mlp.py:make"`` -> the ``make`` function of that file."""
    path, _, name = factory.rpartition(":")
    spec = importlib.util.spec_from_file_location(Path(path).stem + "_factory", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, parallel, factory, kwargs, out) -> None:  # type: ignore[no-untyped-def]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, (x,) = load_factory(factory)(**kwargs)
        names = parallel.dp_axes + ((parallel.tp_axis,) if parallel.tp_axis else ())
        sizes = (world,) if len(names) == 1 else (world // 2, 2)
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        sharded = parallel.apply(copy.deepcopy(model), mesh)
        dp_rank = mesh[parallel.dp_axes[0]].get_local_rank() if parallel.dp_axes else 0
        dp_size = mesh[parallel.dp_axes[0]].size() if parallel.dp_axes else 1
        loss = step_loss(sharded, (x.chunk(dp_size)[dp_rank],))
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
        if rank == 0:
            torch.save({"loss": total / world, "grads": grads}, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    _finish()


def _finish() -> None:
    """End a rank whose work succeeded: wait for the others, tear the group down and leave
    without interpreter finalization. About one run in six to twenty, a child that finalized
    normally died in ``std::terminate`` ("terminate called without an active exception", a
    native thread still joinable at teardown) after its results were written, and ``mp.spawn``
    reported the whole run failed."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_gloo(parallel: Any, factory: str, world: int, **kwargs: Any) -> dict[str, Any]:
    """Spawn ``world`` gloo ranks; returns ``{"loss": mean loss, "grads": {fqn: full grad}}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        args = (world, _free_port(), parallel, factory, kwargs, out)
        mp.spawn(_worker, args=args, nprocs=world, join=True)
        return torch.load(out)


def _pipeline_worker(rank: int, world: int, port: int, spec, factory, kwargs, out) -> None:  # type: ignore[no-untyped-def]
    from .pipeline import build_pipeline_schedule, build_pipeline_stages

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, (inputs,) = load_factory(factory)(**kwargs)
        ids = inputs["input_ids"]
        labels = inputs.get("labels", ids)
        names = tuple(name for name, _ in spec.stage_mesh)
        sizes = (spec.stages, *(n for _, n in spec.stage_mesh))
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("pp", *names))  # pp major
        index = rank // spec.stage_size
        inner = mesh[names] if names else None
        group = mesh["pp"].get_group()
        stages = build_pipeline_stages(spec, model, index, group=group, stage_mesh=inner)
        schedule = build_pipeline_schedule(spec, stages)
        losses: list[torch.Tensor] = []
        if index == 0:  # runs (virtual) stage 0
            schedule.step(ids)
        elif index == spec.stages - 1:  # runs the last (virtual) stage
            schedule.step(target=labels, losses=losses)
        else:
            schedule.step()
        grads = {
            n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for stage in stages
            for n, p in stage.submod.named_parameters()
            if p.grad is not None
        }
        if rank % spec.stage_size == 0:  # one rank per stage saves (all gathered above)
            torch.save({"grads": grads, "losses": losses}, Path(out) / f"stage{index}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    _finish()


def run_pipeline_on_gloo(spec: Any, factory: str, **kwargs: Any) -> dict[str, Any]:
    """Run one pipelined step on gloo: ``spec.stages`` stages of ``spec.stage_size`` ranks
    each (the stage's parameters split over them as planned).

    The factory returns ``(model, ({"input_ids": ids, "labels": ids},))`` (HF style).
    Returns ``{"loss": mean micro-batch loss, "grads": {fqn: grad}}`` over all stages.
    """
    world = spec.stages * spec.stage_size
    with tempfile.TemporaryDirectory() as tmp:
        args = (world, _free_port(), spec, factory, kwargs, tmp)
        mp.spawn(_pipeline_worker, args=args, nprocs=world, join=True)
        parts = [torch.load(Path(tmp) / f"stage{r}.pt") for r in range(spec.stages)]
    grads = {name: g for part in parts for name, g in part["grads"].items()}
    return {"loss": torch.stack(parts[-1]["losses"]).mean().detach(), "grads": grads}
