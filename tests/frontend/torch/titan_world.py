"""Run torchtitan's ``parallelize_llama`` with an emitted configuration in a fresh process.

``python titan_world.py fake '<json>'`` applies it to the Llama 3 model on a fake process group
of exactly the configuration's world size and prints each parameter's placements as JSON;
``python titan_world.py gloo '<json>'`` runs one training step's loss on gloo ranks (CPU).
A fresh process per run: torchtitan builds its world mesh with ``init_device_mesh`` over the
whole default group, so the group must have exactly the configuration's ranks.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def point_torchtitan_at_cpu() -> None:
    """torchtitan picks ``device_type = "cuda"`` when no accelerator is present
    (``torchtitan.tools.utils.get_device_info``); ``ParallelDims.build_mesh`` reads the module
    global it imported from there. On CPU the mesh must be a ``cpu`` mesh, so that global is
    pointed at "cpu" (torchtitan's own unit tests patch the same name). The one patch of
    torchtitan's device handling in this repository."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"


def sum_reductions_for_gloo(model) -> None:  # type: ignore[no-untyped-def]
    """torchtitan turns FSDP's gradient division off (``gradient_divide_factor=1``), which
    FSDP2 reduces with ``PREMUL_SUM``, an op gloo lacks; FSDP2's public switch makes it a
    plain sum with the (unit) scaling done apart. Same gradients, CPU-runnable."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def tiny_args(spec: dict):  # type: ignore[no-untyped-def]
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    if "flavor_args" in spec:
        return TransformerModelArgs(**spec["flavor_args"])
    return llama3_args[spec["flavor"]]


def fake(spec: dict) -> dict:
    from shardplan.frontend.torch import torchtitan as tt
    from shardplan.solver.titan_config import TitanConfig
    from torch.testing._internal.distributed.fake_pg import FakeStore  # private: the fake backend

    config = TitanConfig.from_overrides(spec["overrides"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=config.world_size)
    point_torchtitan_at_cpu()
    model = tt.build_model(spec["flavor"])
    tt.parallelize(config, model, config.world_size)
    return {k: str(v) for k, v in tt.placements(model).items()}


def _gloo_rank(rank: int, spec: dict, port: int, out: str) -> None:
    from shardplan.frontend.torch import torchtitan as tt
    from shardplan.solver.titan_config import TitanConfig
    from torch.distributed.tensor.parallel import loss_parallel
    from torchtitan.models.llama3 import Transformer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    config = TitanConfig.from_overrides(spec["overrides"])
    dist.init_process_group("gloo", rank=rank, world_size=config.world_size)
    point_torchtitan_at_cpu()
    torch.manual_seed(0)
    model = Transformer(tiny_args(spec))
    with torch.no_grad():
        model.init_weights()
    tokens = torch.tensor(spec["tokens"])
    tt.parallelize(config, model, config.world_size)
    sum_reductions_for_gloo(model)
    dp_rank = rank // (config.world_size // config.data_parallel)  # tp is the inner axis
    mine = tokens.chunk(config.data_parallel)[dp_rank]
    with loss_parallel():
        loss = tt.cross_entropy(model(mine), mine)
        loss.backward()
    total = loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
    total = total.clone()
    dist.all_reduce(total)
    if rank == 0:
        torch.save({"loss": float(total) / config.world_size}, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def gloo(spec: dict) -> dict:
    import socket

    import torch.multiprocessing as mp
    import torchtitan.models.llama3
    from shardplan.frontend.torch import torchtitan  # noqa: F401
    from shardplan.solver.titan_config import TitanConfig

    world = TitanConfig.from_overrides(spec["overrides"]).world_size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "loss.pt")
        # fork: the children share the parent's imports (torch, torchtitan: seconds each to
        # import again); CPU only, so no CUDA state is forked.
        mp.start_processes(_gloo_rank, args=(spec, port, out), nprocs=world, join=True,
                           start_method="fork")  # fmt: skip
        return torch.load(out)


if __name__ == "__main__":
    mode, text = sys.argv[1], sys.argv[2]
    result = {"fake": fake, "gloo": gloo}[mode](json.loads(text))
    print("RESULT " + json.dumps(result))
