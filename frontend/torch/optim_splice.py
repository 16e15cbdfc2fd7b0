"""Append the optimizer update to a traced forward+backward graph, one trace per parameter class.

Tracing ``optim.update`` inside the step's ``make_fx`` costs one proxy dispatch per op per
parameter: ResNet-50's 161 parameters took ~2.3 s CPU, 40% of its capture. The update of one
parameter depends only on the (shape, dtype) of the parameter, its gradient and its states, so
each distinct class is traced once (a small ``make_fx`` on fake tensors of the step's own fake
mode) and its nodes are copied into the step graph for every parameter of that class, wired to
that parameter's placeholder, gradient and state placeholders. The result is the graph the
in-trace loop recorded: the same ops in the same order, the same ``custom`` meta (``mark`` on the
gradient alias, ``module: optimizer`` on the update), the same fake values (shared between
copies of a class: they are read, never mutated).

The updates are elementwise, so a class is wider than a shape: contiguous parameters of one
rank and dtypes share one trace (ResNet-50: 28 shape classes, 3 traces), and each copy's
values are re-shaped to its parameter (``_reshaped``). A class whose traced update is not
elementwise (a value of another shape or layout) is traced again per shape.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from . import optim

_GRAD_TAG = "grad:"


def in_trace(spec: optim.OptimizerSpec, mark: Any, names, params, grads, states) -> list:  # type: ignore[no-untyped-def]
    """Inside the step's trace: mark each gradient, then update every parameter that has one
    (per parameter: the reference ``append_updates`` must match node for node)."""
    per = len(spec.state_names)
    new_params, new_states = [], []
    for i, (name, p, g) in enumerate(zip(names, params, grads, strict=True)):
        if g is None:
            continue
        g = mark(g, f"{_GRAD_TAG}{name}")
        with fx_traceback.annotate({"module": "optimizer"}):
            new_p, new_s = optim.update(spec, p, g, list(states[i * per : (i + 1) * per]))
        new_params.append(new_p)
        new_states.extend(new_s)
    return [*new_params, *new_states]


def _class_key(p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.stride()) for t in (p, g, *states))


def _wide_key(p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor]) -> tuple:
    """The class of an elementwise update: rank and dtypes when every tensor is contiguous and
    of the parameter's shape, else the exact (shape, dtype, stride) class."""
    tensors = (p, g, *states)
    if all(t.shape == p.shape and t.is_contiguous() for t in tensors):
        return ("wide", p.dim(), *(t.dtype for t in tensors))
    return _class_key(p, g, states)


def _elementwise(template: list, shape: torch.Size) -> bool:
    """Every value of the traced update is a contiguous tensor of the parameter's ``shape``."""
    _, ops, _ = template
    vals = [n.meta.get("val") for n in ops]
    return all(isinstance(v, torch.Tensor) and v.shape == shape and v.is_contiguous() for v in vals)


def _reshaped(val: torch.Tensor, shape: torch.Size, cache: dict) -> torch.Tensor:
    """A contiguous fake tensor like ``val`` (same fake mode and dtype) of ``shape``."""
    key = (tuple(shape), val.dtype)
    if key not in cache:
        with val.fake_mode:  # type: ignore[attr-defined]
            cache[key] = torch.empty(shape, dtype=val.dtype, device=val.device)
    return cache[key]


def _templates(spec: optim.OptimizerSpec, mark: Any, reps: dict[tuple, tuple]) -> dict[tuple, list]:
    """Per class key, the nodes of the marked update of one parameter of that class.

    All classes are traced in one ``make_fx`` call (its fixed cost is ~30 ms; ResNet-50 has 28
    classes); each class's nodes are told apart by a ``_class`` entry of their custom meta,
    dropped when they are copied. A class's list starts with its placeholders (param, grad,
    states) and ends with its outputs' nodes (a list: new param, new states)."""
    keys = list(reps)

    def all_classes(groups):  # type: ignore[no-untyped-def]
        out = []
        for k, (p, g, s) in enumerate(groups):
            with fx_traceback.annotate({"_class": k}):
                g = mark(g, _GRAD_TAG)
                with fx_traceback.annotate({"module": "optimizer"}):
                    new_p, new_s = optim.update(spec, p, g, list(s))
            out.append([new_p, *new_s])
        return out

    groups = [(p, g, list(s)) for p, g, s in reps.values()]
    with fx_traceback.preserve_node_meta(), lazy_code():
        gm = make_fx(all_classes, tracing_mode="fake")(groups)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    per = [2 + len(s) for _, _, s in groups]
    starts = [sum(per[:k]) for k in range(len(per))]
    outputs = iter(nodes[-1].args[0])  # flat: per class, new param then new states
    found: dict[tuple, list] = {}
    for k, key in enumerate(keys):
        ops = [n for n in nodes if (n.meta.get("custom") or {}).get("_class") == k]
        outs = [next(outputs) for _ in range(per[k] - 1)]
        found[key] = [placeholders[starts[k] : starts[k] + per[k]], ops, outs]
    return found


def _copy_into(
    graph: torch.fx.Graph, template: list, inputs: list[torch.fx.Node], name: str, shape, cache
) -> list:  # type: ignore[no-untyped-def]
    """Copy a class's update nodes into ``graph`` (at its insert point) for one parameter of
    ``shape`` (an elementwise template traced at another shape gets its values re-shaped;
    None: an exact class, whose values are its own)."""
    placeholders, ops, outputs = template
    env: dict[torch.fx.Node, torch.fx.Node] = dict(zip(placeholders, inputs, strict=True))
    for node in ops:
        new = graph.node_copy(node, lambda a: env[a])
        custom = {k: v for k, v in node.meta["custom"].items() if k != "_class"}
        if custom.get("mark") == _GRAD_TAG:
            custom["mark"] = f"{_GRAD_TAG}{name}"
        new.meta["custom"] = custom
        val = node.meta.get("val")
        if shape is not None and isinstance(val, torch.Tensor) and val.shape != shape:
            new.meta["val"] = val = _reshaped(val, shape, cache)
            if "tensor_meta" in new.meta:
                new.meta["tensor_meta"] = new.meta["tensor_meta"]._replace(
                    shape=val.shape, stride=val.stride()
                )
        env[node] = new
    return [env[n] for n in outputs]


def append_updates(
    gm: torch.fx.GraphModule,
    spec: optim.OptimizerSpec,
    mark: Any,
    layout: tuple[int, int, int],
    updated: list[tuple[int, str, torch.Tensor, torch.Tensor, list[torch.Tensor]]],
) -> None:
    """Rewrite ``gm`` (outputs ``loss, *grads``) to output ``loss, *new_params, *new_states``.

    ``layout``: (parameters, buffers, states) placeholder counts; ``updated``: per parameter with
    a gradient, ``(index, name, fake param, fake grad, fake states)`` in parameter order."""
    n_params, n_buffers, _ = layout
    per = len(spec.state_names)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    loss, *grads = output.args[0]
    keys = [_wide_key(p, g, states) for _, _, p, g, states in updated]
    reps: dict[tuple, tuple] = {}
    for key, (_, _, p, g, states) in zip(keys, updated, strict=True):
        reps.setdefault(key, (p, g, states))
    templates = _templates(spec, mark, reps)
    narrow = {
        k for k, t in templates.items() if k[0] == "wide" and not _elementwise(t, reps[k][0].shape)
    }
    exact: dict[tuple, tuple] = {}
    for n, (_, _, p, g, states) in enumerate(updated):
        if keys[n] in narrow:  # not elementwise after all: traced per exact class
            keys[n] = _class_key(p, g, states)
            exact.setdefault(keys[n], (p, g, states))
    templates.update(_templates(spec, mark, exact) if exact else {})
    new_params: list[torch.fx.Node] = []
    new_states: list[torch.fx.Node] = []
    cache: dict[tuple, torch.Tensor] = {}
    with graph.inserting_before(output):
        for key, (i, name, p, _, _), grad in zip(keys, updated, grads, strict=True):
            shape = p.shape if key[0] == "wide" else None  # exact: its values are the trace's
            first_state = n_params + n_buffers + i * per
            inputs = [placeholders[i], grad, *placeholders[first_state : first_state + per]]
            new_p, *new_s = _copy_into(graph, templates[key], inputs, name, shape, cache)
            new_params.append(new_p)
            new_states.extend(new_s)
    output.args = ((loss, *new_params, *new_states),)
    _flat_outputs(graph, 1 + len(new_params) + len(new_states))
    gm.recompile()


def lazy_code():  # type: ignore[no-untyped-def]
    """A context in which ``make_fx`` builds graph modules that generate their Python code on
    first call (``torch.fx._lazy_graph_module``, private; the one place it is used). Planning
    only walks the graph: ResNet-50's step (~5k nodes) was code-generated twice, after the
    trace and after the splice (~0.25 s each on the 2-core box); a caller that runs the module
    (``follow_plan``, the tests) gets its code on the first call as before."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def _flat_outputs(graph: torch.fx.Graph, count: int) -> None:
    """Make the graph module return a flat tuple of ``count`` values, as the in-trace step did.

    The one private API here: make_fx's graph unflattens its outputs by the traced function's
    output spec (``loss, *grads``), held by fx's pytree code generator; it is rebuilt with the
    new spec so ``gm(...)`` still runs."""
    info = getattr(graph._codegen, "pytree_info", None)
    if info is None:
        return
    from torch.fx.graph import _PyTreeCodeGen
    from torch.utils._pytree import tree_flatten

    spec = tree_flatten(tuple(range(count)))[1]
    graph.set_codegen(_PyTreeCodeGen(info._replace(out_spec=spec)))
