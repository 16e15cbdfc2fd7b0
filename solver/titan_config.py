"""torchtitan's training configuration as shardplan reads and writes it (no torch import).

A ``TitanConfig`` holds the knobs of torchtitan 0.2's ``JobConfig`` that decide how a Llama
step is parallelised: the five degrees (``ParallelDims``: dp_replicate x dp_shard x cp x tp x pp
= world size), the pipeline schedule, micro-batch size and layers per stage, the activation
checkpoint mode, the mixed-precision parameter dtype and the batch. It maps both ways to the
command-line overrides torchtitan's ``ConfigManager`` parses (``--parallelism.
tensor_parallel_degree 8``) and to shardplan's own terms: the mesh torchtitan builds
(``pp, dp_replicate, dp_shard, cp, tp``, tp innermost) and the ``ParallelStrategy`` of its fixed
plan (``parallelize_llama``: Megatron column/row TP with sequence parallelism, FSDP2 over
``dp_shard x cp``, HSDP replicas over ``dp_replicate``), so the cost model prices it like any
hand-written strategy. torchtitan's own checks run in ``frontend/torch/torchtitan.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..costmodel.cluster import Cluster
from ..ir import Mesh
from ..ir.errors import TitanConfigError
from .strategies import ParallelStrategy, torchtitan

AC_MODES = ("none", "selective", "full")
SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved"}
"""torchtitan's ``pipeline_parallel_schedule`` names -> the cost model's schedule names."""
DTYPES = ("bfloat16", "float32")
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The order torchtitan unflattens its world mesh in (``ParallelDims.build_mesh``)."""


@dataclass(frozen=True, slots=True)
class TitanConfig:
    """One torchtitan configuration.

    Invariants (checked by ``check``): every degree >= 1 and their product is the world size;
    ``local_batch_size`` is per data-parallel rank (dp_replicate x dp_shard ranks share a
    batch); with ``pp > 1`` the micro-batch size divides it and there are at least as many
    micro-batches as pipeline stages.

        TitanConfig(dp_shard=8, tp=8, local_batch_size=2, seq_len=8192).overrides()
        # ['--parallelism.data_parallel_replicate_degree', '1', ...]
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    local_batch_size: int = 8
    seq_len: int = 2048
    ac_mode: str = "none"
    selective_ac_option: str = "op"
    """``"op"`` (save matmul outputs, recompute the rest) or an integer n as text (full
    recomputation of every n-th layer)."""
    pipeline_schedule: str = "1F1B"
    microbatch_size: int = 1
    layers_per_stage: int | None = None
    mixed_precision_param: str = "bfloat16"
    flavor: str | None = None
    """torchtitan's ``model.flavor`` (``debugmodel``, ``8B``, ``70B``...); None leaves it out."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "local_batch_size",
                     "seq_len", "microbatch_size"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TitanConfigError(
                    f"torchtitan {name} must be a positive integer, not {value!r}"
                )
        if self.ac_mode not in AC_MODES:
            raise TitanConfigError(
                f"activation_checkpoint.mode {self.ac_mode!r}: use one of {AC_MODES}"
            )
        if self.selective_ac_option != "op" and not self.selective_ac_option.isdigit():
            raise TitanConfigError(
                f"selective_ac_option {self.selective_ac_option!r}: 'op' or a layer interval "
                "such as '2'"
            )
        if self.pipeline_schedule not in SCHEDULES:
            raise TitanConfigError(
                f"pipeline_parallel_schedule {self.pipeline_schedule!r}: shardplan prices "
                f"{sorted(SCHEDULES)}"
            )
        if self.mixed_precision_param not in DTYPES:
            raise TitanConfigError(
                f"mixed_precision_param {self.mixed_precision_param!r}: use one of {DTYPES}"
            )

    # -- degrees ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.data_parallel

    @property
    def microbatches(self) -> int:
        return self.local_batch_size // self.microbatch_size

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pipeline_schedule == "Interleaved1F1B" else 1

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    def label(self) -> str:
        parts = [f"{a}{n}" for a, n in self.degrees().items() if n > 1] or ["single"]
        ac = self.ac_mode if self.selective_ac_option == "op" or self.ac_mode != "selective" \
            else f"sel{self.selective_ac_option}"  # fmt: skip
        text = "x".join(parts) + f" ac={ac}"
        if self.pp > 1:
            text += f" {self.pipeline_schedule} mb={self.microbatches}"
        return text

    # -- torchtitan's own words ---------------------------------------------------------------
    def to_dict(self) -> dict[str, dict[str, object]]:
        """The JobConfig sections and fields this configuration sets (TOML-shaped)."""
        parallelism: dict[str, object] = {
            "data_parallel_replicate_degree": self.dp_replicate,
            "data_parallel_shard_degree": self.dp_shard,
            "tensor_parallel_degree": self.tp,
            "context_parallel_degree": self.cp,
            "pipeline_parallel_degree": self.pp,
        }
        if self.pp > 1:
            parallelism["pipeline_parallel_schedule"] = self.pipeline_schedule
            parallelism["pipeline_parallel_microbatch_size"] = self.microbatch_size
            parallelism["pipeline_parallel_first_stage_less_layers"] = 0
            parallelism["pipeline_parallel_last_stage_less_layers"] = 0
            if self.layers_per_stage is not None:
                parallelism["pipeline_parallel_layers_per_stage"] = self.layers_per_stage
        ac: dict[str, object] = {"mode": self.ac_mode}
        if self.ac_mode == "selective":
            ac["selective_ac_option"] = self.selective_ac_option
        model = {"model": {"name": "llama3", "flavor": self.flavor}} if self.flavor else {}
        return {
            **model,
            "training": {
                "local_batch_size": self.local_batch_size,
                "seq_len": self.seq_len,
                "mixed_precision_param": self.mixed_precision_param,
            },
            "parallelism": parallelism,
            "activation_checkpoint": ac,
        }

    def overrides(self) -> list[str]:
        """The command-line overrides (``--section.key value`` pairs) torchtitan parses."""
        out: list[str] = []
        for section, fields in self.to_dict().items():
            for key, value in fields.items():
                out += [f"--{section}.{key}", str(value)]
        return out

    def command(self, nproc_per_node: int = 8) -> str:
        """A launch line: torchtitan's ``run_train.sh`` style ``torchrun`` with the overrides."""
        nodes = max(1, self.world_size // nproc_per_node)
        per_node = min(self.world_size, nproc_per_node)
        return (
            f"torchrun --nnodes {nodes} --nproc_per_node {per_node} -m torchtitan.train "
            + " ".join(self.overrides())
        )

    @classmethod
    def from_overrides(cls, args: list[str] | str) -> TitanConfig:
        """Read the overrides ``overrides()`` writes (``--a.b v`` or ``--a.b=v``); keys it does
        not model are a ``TitanConfigError`` naming them."""
        tokens = args.split() if isinstance(args, str) else list(args)
        values: dict[str, str] = {}
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if not key.startswith("--"):
                raise TitanConfigError(f"expected a --section.key override, got {key!r}")
            if "=" in key:
                key, value = key.split("=", 1)
                i += 1
            elif i + 1 < len(tokens):
                value, i = tokens[i + 1], i + 2
            else:
                raise TitanConfigError(f"override {key} has no value")
            values[key[2:].replace("-", "_")] = value
        return cls(**_fields_from(values))

    # -- shardplan's words --------------------------------------------------------------------
    def mesh(self, cluster: str | Cluster = "h100-sxm") -> Mesh:
        """The mesh torchtitan builds, axes of size 1 left out (tp innermost), on ``cluster``
        (a catalogue name or a cluster object the mesh then holds)."""
        axes = [(a, n) for a, n in self.degrees().items() if n > 1] or [("dp_shard", 1)]
        return Mesh(axes, cluster=cluster)

    def strategy(self) -> ParallelStrategy:
        """torchtitan's fixed plan as a ``ParallelStrategy`` on ``mesh()`` (module docstring)."""
        return torchtitan(
            self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.ac_mode,
            self.selective_ac_option, SCHEDULES[self.pipeline_schedule], self.microbatches,
            name="torchtitan[" + self.label() + "]",
        )  # fmt: skip

    def check(self, world_size: int, n_layers: int, n_heads: int, n_kv_heads: int) -> None:
        """torchtitan's checks that need no torch (``ParallelDims``, the TP/CP sequence
        divisor, the head split, DDP's one-dimension rule, the pipeline's micro-batches)."""
        for problem in self.problems(world_size, n_layers, n_heads, n_kv_heads):
            raise TitanConfigError(problem)

    def problems(self, world_size: int, n_layers: int, n_heads: int, n_kv_heads: int) -> list[str]:
        out = []
        if self.world_size != world_size:
            out.append(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * "
                f"tp({self.tp}) * pp({self.pp}) = {self.world_size} != world size {world_size}"
            )
        if n_heads % self.tp or n_kv_heads % self.tp:
            out.append(
                f"tp {self.tp} must divide the heads ({n_heads}) and KV heads ({n_kv_heads})"
            )
        divisor = self.tp * 2 * self.cp
        if self.seq_len % divisor:
            out.append(f"seq_len {self.seq_len} must be divisible by tp * 2 * cp = {divisor}")
        if (
            self.dp_replicate > 1
            and self.dp_shard * self.cp == 1
            and self.dp_replicate != world_size
        ):
            out.append(
                "DDP (dp_replicate without dp_shard) cannot combine with tp/pp in torchtitan"
            )
        out += self._pipeline_problems(n_layers)
        return out

    def _pipeline_problems(self, n_layers: int) -> list[str]:
        if self.pp == 1:
            return []
        stages = self.pp * self.stages_per_rank
        out = []
        if self.local_batch_size % self.microbatch_size:
            out.append(
                f"local_batch_size {self.local_batch_size} must be divisible by "
                f"pipeline_parallel_microbatch_size {self.microbatch_size}"
            )
        elif self.microbatches < stages:
            out.append(f"{self.microbatches} micro-batches are fewer than the {stages} stages")
        if n_layers % stages:
            out.append(f"{n_layers} layers do not split evenly into {stages} pipeline stages")
        return out

    def replace(self, **changes: object) -> TitanConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


_KEYS = {
    "parallelism.data_parallel_replicate_degree": ("dp_replicate", int),
    "parallelism.data_parallel_shard_degree": ("dp_shard", int),
    "parallelism.tensor_parallel_degree": ("tp", int),
    "parallelism.context_parallel_degree": ("cp", int),
    "parallelism.pipeline_parallel_degree": ("pp", int),
    "parallelism.pipeline_parallel_schedule": ("pipeline_schedule", str),
    "parallelism.pipeline_parallel_microbatch_size": ("microbatch_size", int),
    "parallelism.pipeline_parallel_layers_per_stage": ("layers_per_stage", int),
    "training.local_batch_size": ("local_batch_size", int),
    "training.seq_len": ("seq_len", int),
    "training.mixed_precision_param": ("mixed_precision_param", str),
    "activation_checkpoint.mode": ("ac_mode", str),
    "activation_checkpoint.selective_ac_option": ("selective_ac_option", str),
    "model.flavor": ("flavor", str),
}
_IGNORED = {
    "model.name",
    "parallelism.pipeline_parallel_first_stage_less_layers",
    "parallelism.pipeline_parallel_last_stage_less_layers",
}


def _fields_from(values: dict[str, str]) -> dict[str, object]:
    unknown = sorted(set(values) - set(_KEYS) - _IGNORED)
    if unknown:
        raise TitanConfigError(
            f"torchtitan overrides shardplan does not price: {unknown}; it reads {sorted(_KEYS)}"
        )
    out: dict[str, object] = {}
    for key, text in values.items():
        if key in _IGNORED:
            continue
        name, kind = _KEYS[key]
        try:
            out[name] = kind(text)
        except ValueError:
            raise TitanConfigError(f"--{key} {text!r}: expected {kind.__name__}") from None
    if out.get("dp_shard") == -1:
        raise TitanConfigError("data_parallel_shard_degree -1: give the degree (shardplan does "
                               "not know the world size from the overrides alone)")  # fmt: skip
    return out
