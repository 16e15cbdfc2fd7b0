"""Emit a pipeline plan for ``torch.distributed.pipelining``: split points, schedule, stages.

The planner chooses contiguous layer ranges per stage on the captured graph
(``plan.pipeline``). Here they become the tracer front end's split points
(``{"model.layers.4": SplitPoint.BEGINNING}``: a new stage starts at each stage's first layer),
the schedule class and the micro-batch count. ``build_pipeline_stage`` splits the model by hand,
torchtitan style: this rank keeps its own layers (under their original FQNs), the embedding on
the first stage and the final norm and head on the last, and wraps them in a ``PipelineStage``.
The tracer front end (``pipeline(model, mb_args, split_spec)``) takes the same split spec, but
``torch.export``'s unflattening of Hugging Face models loses inputs of nested modules
(``position_ids``), so it is not used here. Tensor parallelism inside a stage: the plan's
intra-stage layouts are for the sub-mesh (``plan.stage_mesh``); each stage's parameters become
DTensors on that stage's slice of the device mesh (``TensorParallelStage``), and the stage
sends and receives whole (replicated) activations.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, SplitPoint
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

from ...ir import FrontendError
from ...solver.plan import PipelinePlan, Plan

_SCHEDULES: dict[str, type[PipelineScheduleSingle] | type[PipelineScheduleMulti]] = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved": ScheduleInterleaved1F1B,
}


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """What every pipeline rank needs, as plain data (picklable for spawned processes).

    Invariants: ``len(split_points) == stages * chunks - 1``; ``microbatches >= stages`` for
    1F1B; interleaved: ``microbatches`` divisible by ``stages``.
    """

    split_points: tuple[str, ...]
    """Module paths where a (virtual) stage begins (``SplitPoint.BEGINNING``), in stage order."""
    schedule: str
    """``1f1b``, ``gpipe`` or ``interleaved``."""
    microbatches: int
    stages: int
    """Pipeline ranks (the pp axis)."""
    stack: str = "model.layers"
    """Module path of the layer stack."""
    stage_layers: tuple[tuple[int, ...], ...] = ()
    """Layer indices of each virtual stage, in pipeline order: with ``chunks`` > 1, virtual
    stage ``c * stages + r`` is model chunk ``c`` of pp rank ``r``."""
    stage_mesh: tuple[tuple[str, int], ...] = ()
    """Axes of the mesh inside one stage (``plan.stage_mesh``); empty or size 1: no parallelism."""
    placements: tuple[tuple[str, tuple[Placement, ...]], ...] = ()
    """Parameter FQN -> DTensor placements on the stage mesh (``plan.to_placements()``)."""
    chunks: int = 1
    """Model chunks per pp rank (interleaved 1F1B)."""

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        """The virtual stage indices pp rank ``rank`` runs (one unless interleaved)."""
        return tuple(c * self.stages + rank for c in range(self.chunks))

    @property
    def stage_size(self) -> int:
        return math.prod(n for _, n in self.stage_mesh)

    @property
    def split_spec(self) -> dict[str, SplitPoint]:
        return {path: SplitPoint.BEGINNING for path in self.split_points}

    @property
    def schedule_class(self) -> type[PipelineScheduleSingle] | type[PipelineScheduleMulti]:
        return _SCHEDULES[self.schedule]


def _pipeline_of(plan: Plan) -> PipelinePlan:
    if plan.pipeline is None:
        raise FrontendError(
            f"this plan has no pipeline stages (mesh {plan.mesh}); plan on a mesh with an axis "
            'named "pp" of size > 1, e.g. sp.Mesh({"pp": 2, "dp": 2})'
        )
    return plan.pipeline


def pipeline_spec(plan: Plan) -> PipelineSpec:
    """The plan's stages, schedule and micro-batches for ``torch.distributed.pipelining``."""
    pipe = _pipeline_of(plan)
    if pipe.schedule not in _SCHEDULES:
        raise FrontendError(
            f"schedule {pipe.schedule!r} has no torch pipelining schedule here; "
            f"re-plan with schedule= one of {sorted(_SCHEDULES)}"
        )
    chunks = pipe.chunks if pipe.schedule == "interleaved" else 1
    if chunks > 1:
        layers = tuple(s.chunk_layers[c] for c in range(chunks) for s in pipe.stages)
    else:
        layers = tuple(stage.layers for stage in pipe.stages)
    stack = pipe.stages[0].stack
    points = tuple(f"{stack}.{chunk[0]}" for chunk in layers[1:])
    inner = tuple(plan.stage_mesh.axes) if plan.stage_mesh.size > 1 else ()
    placements = tuple(plan.to_placements().items()) if inner else ()
    return PipelineSpec(
        points, pipe.schedule, pipe.microbatches, len(pipe.stages), stack, layers, inner,
        placements, chunks,
    )  # fmt: skip


def pipeline_split_spec(plan: Plan) -> dict[str, SplitPoint]:
    """``{"model.layers.4": SplitPoint.BEGINNING, ...}``: one split per stage boundary."""
    return pipeline_spec(plan).split_spec


def pipeline_schedule(
    plan: Plan,
) -> tuple[type[PipelineScheduleSingle] | type[PipelineScheduleMulti], int]:
    """(schedule class, number of micro-batches), e.g. ``(Schedule1F1B, 8)``."""
    spec = pipeline_spec(plan)
    return spec.schedule_class, spec.microbatches


def build_pipeline_stage(
    spec: PipelineSpec | Plan,
    model: nn.Module,
    stage_index: int,
    device: torch.device | str = "cpu",
    group: Any = None,
    stage_mesh: DeviceMesh | None = None,
) -> PipelineStage:
    """The ``PipelineStage`` of (virtual) stage ``stage_index``: the part of ``model`` it runs,
    under the model's own parameter names (the modules are shared with ``model``, not copied).

    Args:
      spec: a ``PipelineSpec`` or the plan itself.
      model: a Hugging Face decoder-only causal LM (``model.embed_tokens``, ``model.layers``,
        ``model.rotary_emb``, ``model.norm``, ``lm_head``: Llama, Mistral, Qwen2); every rank
        builds the whole model and keeps its stage's part.
      group: the pipeline process group (default: the world).
      stage_mesh: this stage's device mesh (the plan mesh's axes) when the plan splits
        layers inside a stage; its parameters are then distributed as planned.
    """
    spec = pipeline_spec(spec) if isinstance(spec, Plan) else spec
    module: nn.Module = CausalLMStage(model, spec, stage_index)
    if spec.stage_size > 1:
        if stage_mesh is None or tuple(stage_mesh.shape) != tuple(n for _, n in spec.stage_mesh):
            raise FrontendError(
                f"this pipeline splits each stage over {dict(spec.stage_mesh)}; pass "
                "stage_mesh=device_mesh[<those axes>] for this rank's stage"
            )
        module = TensorParallelStage(module, dict(spec.placements), stage_mesh)
    return PipelineStage(
        module, stage_index, spec.virtual_stages, torch.device(device), group=group
    )


def build_pipeline_stages(
    spec: PipelineSpec | Plan,
    model: nn.Module,
    rank: int,
    device: torch.device | str = "cpu",
    group: Any = None,
    stage_mesh: DeviceMesh | None = None,
) -> list[PipelineStage]:
    """Every ``PipelineStage`` pp rank ``rank`` runs: one, or with interleaved 1F1B one per
    model chunk (virtual stages ``rank``, ``rank + p``, ...), each holding its own layers."""
    spec = pipeline_spec(spec) if isinstance(spec, Plan) else spec
    return [
        build_pipeline_stage(spec, model, index, device, group, stage_mesh)
        for index in spec.rank_stages(rank)
    ]


class TensorParallelStage(nn.Module):
    """A stage whose parameters are DTensors on the stage mesh, at the planned placements.

    Activations cross stage boundaries whole: the input is made a replicated DTensor and the
    output gathered (``full_tensor``), so ``PipelineStage`` sends plain tensors; inside, the
    same contexts as ``plan.apply`` run the layers (plain tensors act as replicated, views of
    split dims are local reshapes, CPU attention takes the math path)."""

    def __init__(self, stage: nn.Module, placements: dict[str, Any], mesh: DeviceMesh) -> None:
        super().__init__()
        for module_name, module in stage.named_modules():
            for name, param in list(module.named_parameters(recurse=False)):
                fqn = f"{module_name}.{name}" if module_name else name
                tensor = distribute_tensor(
                    param.detach(), mesh, list(placements[fqn]), src_data_rank=None
                )
                module.register_parameter(name, nn.Parameter(tensor, param.requires_grad))
        self.stage = stage
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .emit import _forward_contexts

        replicated = [Replicate()] * self.mesh.ndim
        with contextlib.ExitStack() as stack:
            for context in _forward_contexts(self.mesh):
                stack.enter_context(context)
            out = self.stage(DTensor.from_local(x, self.mesh, replicated, run_check=False))
        return out.full_tensor() if isinstance(out, DTensor) else out

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        """The stage's own FQNs (``model.layers.3...``), without the wrapper's prefix."""
        return self.stage.named_parameters(*args, **kwargs)


class _KeptLayers(nn.Module):
    """A stage's layers under their original indices, so parameter FQNs do not change; it
    iterates and slices like the ``nn.ModuleList`` it replaces."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int | slice) -> Any:
        return list(self._modules.values())[index]


class CausalLMStage(nn.Module):
    """One stage of a decoder-only causal LM: ids (first stage) or hidden states in, hidden
    states or logits (last stage) out. Parameters keep their FQNs (``model.layers.3...``)."""

    def __init__(self, causal_lm: nn.Module, spec: PipelineSpec, index: int) -> None:
        super().__init__()
        base = getattr(causal_lm, "model", None)
        if base is None or not hasattr(base, "rotary_emb") or spec.stack != "model.layers":
            raise FrontendError(
                f"manual stages are built for Hugging Face decoder-only LMs (model.layers, "
                f"model.rotary_emb); got {type(causal_lm).__name__} with stack {spec.stack!r}"
            )
        self.first, self.last = index == 0, index == spec.virtual_stages - 1
        if getattr(causal_lm.config, "tie_word_embeddings", False) and spec.stages > 1:
            raise FrontendError("tied embeddings across pipeline stages are not supported yet")
        self.model = nn.Module()  # the parts this stage runs, under their original names
        self.model.layers = _KeptLayers({i: base.layers[i] for i in spec.stage_layers[index]})
        self.model.rotary_emb = base.rotary_emb
        self.model.embed_tokens = base.embed_tokens if self.first else None
        self.model.norm = base.norm if self.last else None
        self.lm_head = causal_lm.lm_head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(x) if self.first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        rotary = self.model.rotary_emb(hidden, positions)
        for layer in self.model.layers:
            # attention_mask=None: the attention kernels apply the causal mask themselves
            out = layer(hidden, attention_mask=None, position_ids=positions,
                        position_embeddings=rotary)  # fmt: skip
            hidden = out[0] if isinstance(out, tuple) else out
        if not self.last:
            return hidden
        return self.lm_head(self.model.norm(hidden))


def build_pipeline_schedule(
    spec: PipelineSpec | Plan,
    stage: PipelineStage | list[PipelineStage],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The planned schedule over this rank's ``stage`` (a list of them for interleaved 1F1B:
    ``build_pipeline_stages``); gradients are averaged over micro-batches (``scale_grads``),
    so a mean loss per micro-batch gives the full batch's mean gradient."""
    spec = pipeline_spec(spec) if isinstance(spec, Plan) else spec
    stages = stage if isinstance(stage, list) else [stage]
    if spec.chunks > 1:
        return ScheduleInterleaved1F1B(stages, spec.microbatches, loss_fn=loss_fn or causal_lm_loss)
    if len(stages) != 1:
        raise FrontendError(
            f"a {spec.schedule} pipeline runs one stage per rank, got {len(stages)}"
        )
    return spec.schedule_class(stages[0], spec.microbatches, loss_fn=loss_fn or causal_lm_loss)


def causal_lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, as Hugging Face causal LMs compute it from ``labels``."""
    logits = output[0] if isinstance(output, (tuple, list)) else output
    logits = logits[:, :-1].float()
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
