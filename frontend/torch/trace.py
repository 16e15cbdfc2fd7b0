"""Trace an nn.Module's training step (or forward) to one aten graph with fake tensors.

``make_fx`` records forward, ``torch.autograd.grad`` backward and the functional optimizer update
in one FX graph. Nothing large is allocated: parameters, buffers and inputs are replaced by fake
tensors of the same shape (the model may live on ``meta``). Module paths reach the nodes through
``torch.fx.traceback.annotate`` (``node.meta["custom"]["module"]``), and *marks* (an
``aten.alias`` under ``{"mark": ...}``) tag module inputs/outputs and gradients so the lowering
can name them.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import GetSetDescriptorType
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode  # public home of FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode

from ...ir import FrontendError
from . import inputs, optim, optim_splice

LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class Placeholder:
    """One graph input in placeholder order."""

    role: str
    """``param``, ``buffer``, ``state`` or ``input``."""
    path: str
    """FQN (params, buffers), ``fqn#exp_avg`` (states) or the input's path in the call:
    the ``forward`` parameter and pytree steps (``input_ids``, ``xs[1]``), ``loss_inputs[0]``."""


@dataclass
class Traced:
    gm: torch.fx.GraphModule
    placeholders: list[Placeholder]
    outputs: list[tuple[str, str]]
    """Per output: (kind, path) with kind ``loss``, ``param``, ``state`` or ``output``."""
    param_fqns: list[str]
    tied: dict[str, str] = field(default_factory=dict)
    """Alias FQN -> canonical FQN for parameters shared by several modules."""
    boundary_modules: list[str] = field(default_factory=list)
    pins: list[Any] = field(default_factory=list)
    """``shardplan.annotate`` pins, by the ``k`` of their ``pin:<k>`` mark (``annotate.py``)."""


def mark(tensor: torch.Tensor, tag: str) -> torch.Tensor:
    """An ``aten.alias`` carrying ``tag`` in its node meta (identity at run time)."""
    with fx_traceback.annotate({"mark": tag}):
        return torch.ops.aten.alias.default(tensor)


def boundary_modules(model: nn.Module) -> set[str]:
    """Paths of the modules that own parameters directly: their inputs and outputs are marked
    (and ``emit.apply`` aliases them alike under ``follow_plan``, see there)."""
    return {n for n, m in model.named_modules() if any(True for _ in m.parameters(False))}


@contextlib.contextmanager
def module_annotations(model: nn.Module, boundaries: set[str]) -> Iterator[None]:
    """Annotate every op with its module path; mark inputs/outputs of ``boundaries`` modules."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    stack: list[contextlib.AbstractContextManager[None]] = []

    def pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        path = names.get(id(module))
        if path is None:
            return None
        cm = fx_traceback.annotate({"module": path})
        cm.__enter__()
        stack.append(cm)
        if path not in boundaries:
            return None
        return tuple(
            mark(a, f"in:{path}:{i}") if isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)
        )

    def post(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        path = names.get(id(module))
        if path is None:
            return None
        if path in boundaries and isinstance(out, torch.Tensor):
            out = mark(out, f"out:{path}:0")
        stack.pop().__exit__(None, None, None)
        return out

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while stack:
            stack.pop().__exit__(None, None, None)


def default_loss(output: Any) -> torch.Tensor:
    """The loss when none is given: ``output.loss`` if set, else mean square of the first tensor.

    The square keeps every gradient non-trivial (a plain sum would make d(loss)/d(output) a
    constant that hides layout bugs).
    """
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    return first_tensor(output).float().pow(2).mean()


def first_tensor(output: Any) -> torch.Tensor:
    for t in flatten_outputs(output):
        return t
    raise FrontendError(f"the model returned no tensor ({type(output).__name__}); pass loss_fn=")


def flatten_outputs(output: Any) -> list[torch.Tensor]:
    """Tensors of a model output: a tensor, a tuple/list, a dict or a HF ModelOutput."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for v in output.values() for t in flatten_outputs(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in flatten_outputs(v)]
    return []


def fake_like(mode: FakeTensorMode, t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    """A fake tensor with t's shape/stride/dtype; meta tensors become fake CPU tensors."""
    device = torch.device("cpu") if t.device.type == "meta" else t.device
    with mode:
        fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return fake.requires_grad_(requires_grad and t.dtype.is_floating_point)


def split_inputs(example_inputs: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """One mapping argument means keyword arguments (HF: ``{"input_ids": .., "labels": ..}``)."""
    if len(example_inputs) == 1 and isinstance(example_inputs[0], Mapping):
        return [], dict(example_inputs[0])
    return list(example_inputs), {}


def trace(
    model: nn.Module,
    example_inputs: Sequence[Any],
    train: bool,
    loss_fn: LossFn | None,
    spec: optim.OptimizerSpec,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_inputs: tuple = (),
    optimizer_in_trace: bool = False,
) -> Traced:
    """Trace one step of ``model``; see the module docstring. The example call is bound by
    ``forward``'s signature (``inputs.py``); ``loss_inputs`` reach only ``loss_fn``. The
    optimizer update is traced once per parameter class and spliced in (``optim_splice``);
    ``optimizer_in_trace`` traces it per parameter inside the step instead (the reference the
    splice is tested and benched against)."""
    args, kwargs = inputs.bind(model, tuple(example_inputs), example_kwargs or {})
    signature = inputs.forward_signature(model)
    leaves = inputs.tensor_leaves(args, kwargs, signature)
    leaves += inputs.tree_tensors(tuple(loss_inputs), "loss_inputs")
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    tied = _tied_aliases(model)
    boundaries = boundary_modules(model)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_params = [fake_like(mode, p, requires_grad=train and p.requires_grad)
                   for p in params.values()]  # fmt: skip
    # a frozen parameter (requires_grad=False: Whisper's sinusoidal encoder positions) gets
    # no gradient and no update, as in the user's own step
    trainable = [i for i, p in enumerate(params.values()) if p.requires_grad]
    fake_buffers = [fake_like(mode, b) for b in buffers.values()]
    fake_inputs = [fake_like(mode, t) for _, t in leaves]
    states = [s for p in fake_params for s in _fake_states(mode, spec, p)] if train else []
    names = list(params)
    paths = [path for path, _ in leaves]

    def faked(xs: list[torch.Tensor]) -> Callable[[str, torch.Tensor], torch.Tensor]:
        by_path = dict(zip(paths, xs, strict=True))
        return lambda path, _: by_path[path]

    def call(p: list[torch.Tensor], b: list[torch.Tensor], xs: list[torch.Tensor]) -> Any:
        call_args, call_kwargs = inputs.map_tensors(args, kwargs, signature, faked(xs))
        tensors = {**dict(zip(names, p, strict=True)), **dict(zip(buffers, b, strict=True))}
        with module_annotations(model, boundaries):
            return functional_call(model, tensors, tuple(call_args), call_kwargs, strict=False)

    def loss_of(out: Any, xs: list[torch.Tensor]) -> torch.Tensor:
        with fx_traceback.annotate({"module": "loss"}):
            if loss_fn is None:
                return default_loss(out)
            if loss_inputs:
                return loss_fn(out, *inputs.map_tree(tuple(loss_inputs), "loss_inputs", faked(xs)))
            return loss_fn(out, *inputs.map_tensors(args, {}, signature, faked(xs))[0])

    updated: list[tuple[int, str, torch.Tensor]] = []

    def train_step(p, b, s, xs):  # type: ignore[no-untyped-def]
        loss = loss_of(call(p, b, xs), xs)
        grads = _gradients(loss, p, trainable)
        if optimizer_in_trace:
            return loss, *optim_splice.in_trace(spec, mark, names, p, grads, s)
        updated[:] = [(i, names[i], g) for i, g in enumerate(grads) if g is not None]
        return loss, *[g for _, _, g in updated]  # the update is spliced in below

    def forward(p, b, s, xs):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return tuple(flatten_outputs(call(p, b, xs)))

    step = train_step if train else forward
    from .annotate import collecting

    with (
        fx_traceback.preserve_node_meta(),
        collecting() as pins,
        _TracedCalls(),
        optim_splice.lazy_code(),
    ):
        gm = make_fx(step, tracing_mode="fake")(fake_params, fake_buffers, states, fake_inputs)
    if train and not optimizer_in_trace:
        _splice(gm, mode, spec, updated, (fake_params, fake_buffers, states))
    placeholders = [Placeholder("param", n) for n in names]
    placeholders += [Placeholder("buffer", n) for n in buffers]
    placeholders += [
        Placeholder("state", f"{n}#{s}") for n in names for s in (spec.state_names if train else ())
    ]
    placeholders += [Placeholder("input", path) for path in paths]
    outputs = _output_specs(gm, train, names, spec)
    return Traced(gm, placeholders, outputs, names, tied, sorted(boundaries), pins)


def _gradients(loss: torch.Tensor, params: list[torch.Tensor], trainable: list[int]) -> list:
    """The loss's gradient for each parameter; None for a frozen or unused one."""
    wanted = [params[i] for i in trainable]
    found = torch.autograd.grad(loss, wanted, allow_unused=True) if wanted else ()
    grads: list = [None] * len(params)
    for i, g in zip(trainable, found, strict=True):
        grads[i] = g
    return grads


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_MODULES = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep

_METADATA = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "_is_view", "stride", "storage_offset", "untyped_storage", "is_inference", "is_conj",
        "is_neg", "numel", "dim", "size",
    )
)  # fmt: skip
_PROPERTIES = frozenset(
    torch._C.TensorBase.__dict__[name]
    for name in (
        "shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad_fn",
        "_base", "grad", "output_nr", "_version", "is_meta", "is_cuda", "is_cpu", "is_sparse",
        "is_quantized", "is_nested", "names",
    )
    if name in torch._C.TensorBase.__dict__
)  # fmt: skip
"""Tensor methods and properties that read metadata and record no node: ~99% of the
torch-function calls a CNN's trace makes, answered without the frame walk (a property that
records a node, ``.T`` or ``.mT``, is not among them)."""


def _metadata(func) -> bool:  # type: ignore[no-untyped-def]
    owner = getattr(func, "__self__", None)
    return func in _METADATA or (type(owner) is GetSetDescriptorType and owner in _PROPERTIES)


def _user_line(frame) -> str:  # type: ignore[no-untyped-def]
    """``file.py:line`` of the innermost ``forward`` frame outside torch's own code
    (``torch/nn/modules`` counts as the user's): the line make_fx's stack traces named; ""
    outside any ``forward`` (backward and optimizer ops)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward":
            path = code.co_filename
            if not path.startswith(_TORCH_DIR) or path.startswith(_TORCH_MODULES):
                return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


class _TracedCalls(TorchFunctionMode):
    """What the trace changes about the torch calls it records (one mode: each mode on the
    stack is a Python call per torch call, ~50k of them in a ResNet-50 step).

    - **Source lines** (``Origin.source``): each traced op is annotated with the user's line,
      the innermost ``forward``'s (backward and optimizer ops get none), found by one frame walk
      per call. make_fx's ``record_stack_traces`` did this at ~2x the cost of the rest of a small
      model's capture (a full symbolised traceback per node; its file filter imports
      ``torch.export``, 0.55 s on the first call). Property reads and metadata queries
      (``_METADATA``) record no node and skip the walk.
    - **Attention dropout as the fused kernel**: on a GPU, flash attention applies dropout inside
      the kernel; on the CPU that traces, ``scaled_dot_product_attention`` with ``dropout_p > 0``
      takes the math path (score matrices, softmax, dropout as separate ops), which the cost
      model would price as unfused attention (GPT-2 medium: +69% step time against an H100
      measurement). The captured graph is for planning only, so the call is traced with
      ``dropout_p=0``: the same shapes, FLOPs and layouts as the fused kernel.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _metadata(func):
            return func(*args, **kwargs)
        if func is torch.nn.functional.scaled_dot_product_attention:
            kwargs = dict(kwargs)
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            elif kwargs.get("dropout_p"):
                kwargs["dropout_p"] = 0.0
        line = _user_line(sys._getframe(1))
        if not line:
            return func(*args, **kwargs)
        with fx_traceback.annotate({"source": line}):
            return func(*args, **kwargs)


def _fake_states(mode: FakeTensorMode, spec: optim.OptimizerSpec, p: torch.Tensor) -> list:
    with mode:
        return [
            torch.zeros(p.shape, dtype=torch.float32, device=p.device) for _ in spec.state_names
        ]


def _splice(gm, mode, spec, updated, inputs) -> None:  # type: ignore[no-untyped-def]
    """Append the update of every parameter in ``updated`` (``(index, name, fake grad)``)."""
    fake_params, fake_buffers, states = inputs
    per = len(spec.state_names)
    classes = [
        (i, n, _fresh(mode, fake_params[i]), _fresh(mode, g), states[i * per : (i + 1) * per])
        for i, n, g in updated
    ]
    layout = (len(fake_params), len(fake_buffers), len(states))
    optim_splice.append_updates(gm, spec, mark, layout, classes)


def _fresh(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``mode`` with ``t``'s shape, stride and dtype, outside any trace."""
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def _output_specs(gm, train, names, spec) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """Kinds of the flat outputs, read back from the grad marks (unused params have none)."""
    if not train:
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        return [("output", f"out{i}") for i in range(len(out_node.args[0]))]
    updated = [
        n.meta["custom"]["mark"].split(":", 1)[1]
        for n in gm.graph.nodes
        if n.op == "call_function"
        and str(n.meta.get("custom", {}).get("mark", "")).startswith("grad:")
    ]
    specs = [("loss", "loss")] + [("param", n) for n in updated]
    specs += [("state", f"{n}#{s}") for n in updated for s in spec.state_names]
    return specs


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    canonical: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in canonical:
            tied[name] = canonical[id(p)]
        else:
            canonical[id(p)] = name
    return tied
