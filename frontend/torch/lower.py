"""Lower a traced aten FX graph to the sharding IR.

Each ``call_function`` node goes through the table in ``ops.py`` (keyed by the aten overload
packet name, e.g. ``mm``); a node may become zero, one or several IR ops. Unknown aten ops get
the safe replicated rule and an ``UnsupportedOpWarning`` naming the op and its module path.
"""

from __future__ import annotations

import operator
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ...ir import Graph, Origin, Role, TensorType, UnsupportedOpWarning, Value
from ...ir.rule_helpers import replicated_rule

_DTYPES = {
    torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
    torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2",
}  # fmt: skip

Lowered = Value | None | list["Value | None"]


def tensor_type(t: torch.Tensor) -> TensorType:
    try:
        return TensorType(tuple(int(d) for d in t.shape), _DTYPES[t.dtype])
    except KeyError:
        raise NotImplementedError(f"dtype {t.dtype} has no IR name") from None


@dataclass
class Lowering:
    """Per-graph lowering state: fx node -> IR value(s), plus marks found on the way."""

    graph: Graph
    env: dict[fx.Node, Lowered] = field(default_factory=dict)
    marks: dict[str, str] = field(default_factory=dict)
    """Mark tag (``grad:<fqn>``, ``in:<module>:<i>``, ``out:<module>:0``) -> IR value name."""
    node: fx.Node | None = None
    """The node being lowered (for origins)."""
    module_of: dict[fx.Node, str] = field(default_factory=dict)
    marked_grads: set[str] = field(default_factory=set)
    """Values already marked as a parameter's gradient (``_marked``)."""
    fold_broadcast_weights: bool = False
    """Serving steps: a ``bmm`` whose right operand is a 2-D tensor expanded over the batch
    (HF's ``linear`` on a non-contiguous 3-D input) is lowered as a matmul of that 2-D tensor,
    so the weight is priced once, not once per sequence (``ops.matmul``)."""

    # -- helpers used by the op table ----------------------------------------------------------
    def value(self, arg: Any) -> Value:
        lowered = self.env[arg]
        if not isinstance(lowered, Value):
            raise TypeError(f"{arg} lowered to {lowered!r}, not a single value")
        return lowered

    def tensors(self, args: Sequence[Any]) -> list[Value]:
        """IR values of the tensor arguments, in order (scalars and None skipped)."""
        out: list[Value] = []
        for a in args:
            if isinstance(a, fx.Node) and isinstance(self.env.get(a), Value):
                out.append(self.value(a))
            elif isinstance(a, (list, tuple)):
                out.extend(self.tensors(a))
        return out

    def result_types(self, node: fx.Node) -> list[TensorType]:
        return self.result_types_of(node.meta.get("val"))

    def result_types_of(self, val: Any) -> list[TensorType]:
        vals = val if isinstance(val, (list, tuple)) else [val]
        return [tensor_type(v) for v in vals if isinstance(v, torch.Tensor)]

    def origin(self) -> Origin:
        node = self.node
        if node is None:
            return Origin()
        return Origin(module=self.module_of.get(node, ""), source=_source(node))

    def emit(
        self,
        kind: str,
        operands: Sequence[Value],
        types: Sequence[TensorType],
        attrs: dict[str, Any] | None = None,
        safe: bool = False,
    ) -> list[Value]:
        """Add one IR op; ``safe`` forces the replicated rule (no warning, the caller warned)."""
        origin = self.origin()
        rule = replicated_rule([v.type for v in operands], list(types)) if safe else None
        hint = self.node.name if self.node is not None else ""
        names = [hint] * len(types)
        op = self.graph.add_op(
            kind, operands, types, rule=rule, attrs=attrs, origin=origin, names=names
        )
        return op.results


def _source(node: fx.Node) -> str:
    """``file.py:line`` of the user's code that made the node: the trace's annotation
    (``trace._TracedCalls``), else the innermost user frame of the node's stack trace."""
    line = node.meta.get("custom", {}).get("source")
    if line:
        return str(line)
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not frames:
        return ""
    path, line = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def infer_modules(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Module path per node: annotated forward nodes keep theirs; backward nodes inherit.

    Backward ops carry no annotation. Each takes the *home* of its saved forward inputs (the
    deepest module containing the value and all its forward readers: a weight-gradient ``mm``
    reads a saved activation, an input-gradient ``mm`` the transposed weight), unless the most
    recently computed backward input is inside that home - then it is the more specific place
    (rotary tables, read by every layer, have home ``model``). A residual gradient sum
    ``add(from the layer above, from this layer's branch)`` thus belongs where the backward sweep
    is now, and no layer's path is dragged into the next one.
    """
    module_of: dict[fx.Node, str] = {}
    forward: set[fx.Node] = set()
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        if "module" in custom:
            module_of[node] = str(custom["module"])
            forward.add(node)
            continue
        inputs = node.all_input_nodes
        homes = [_home(module_of, forward, a) for a in inputs if a in forward]
        homes = [h for h in homes if h not in _UNPLACED]
        flowing = [a for a in inputs if a not in forward and module_of.get(a, "") not in _UNPLACED]
        latest = module_of[max(flowing, key=order.__getitem__)] if flowing else None
        home = max(homes, key=lambda m: m.count(".")) if homes else None
        if home is not None and (latest is None or not _inside(latest, home)):
            module_of[node] = home
        elif latest is not None:
            module_of[node] = latest
    for node in reversed(gm.graph.nodes):  # made from nothing (zeros, constants): its readers'
        if node not in module_of and not node.all_input_nodes:
            readers = {module_of.get(u, "") for u in node.users}
            if len(readers) == 1 and (only := readers.pop()) not in _UNPLACED:
                module_of[node] = only
    for node in gm.graph.nodes:  # a parameter's gradient is computed in the parameter's module
        tag = str((node.meta.get("custom") or {}).get("mark", ""))
        source = node.args[0] if node.args else None
        if tag.startswith("grad:") and isinstance(source, fx.Node) and source not in forward:
            module_of[source] = tag[len("grad:") :].rpartition(".")[0]
    previous = ""
    for node in gm.graph.nodes:  # read by nothing either (a backward's empty zeros): its step's
        if node.op == "call_function" and not node.users and not node.all_input_nodes:
            module_of.setdefault(node, previous)
        previous = module_of.get(node, previous)
    return module_of


_UNPLACED = ("", "loss", "optimizer")


def _inside(path: str, ancestor: str) -> bool:
    return path != ancestor and path.startswith(ancestor + ".")


def _home(module_of: dict[fx.Node, str], forward: set[fx.Node], node: fx.Node) -> str:
    """The deepest module path containing a forward value's module and its forward readers'."""
    paths = [module_of.get(node, "")]
    paths += [module_of.get(u, "") for u in node.users if u in forward]
    parts = [p.split(".") for p in paths if p not in _UNPLACED]
    if not parts:
        return ""
    common: list[str] = []
    for segment in zip(*parts, strict=False):
        if len(set(segment)) != 1:
            break
        common.append(segment[0])
    return ".".join(common)


def lower_node(low: Lowering, node: fx.Node) -> None:
    """Lower one call_function node into ``low.env``."""
    from .ops import TABLE

    low.node = node
    if node.target is operator.getitem:
        parent = low.env[node.args[0]]
        low.env[node] = parent[node.args[1]] if isinstance(parent, list) else None
        return
    custom = node.meta.get("custom") or {}
    if "mark" in custom:  # identity alias carrying a tag: no IR op, remember the value
        value = _marked(low, low.value(node.args[0]), str(custom["mark"]))
        low.marks.setdefault(str(custom["mark"]), value.name)
        low.env[node] = value
        return
    packet = getattr(node.target, "_overloadpacket", None)
    name = (
        packet.__name__
        if packet is not None
        else getattr(node.target, "__name__", str(node.target))
    )
    inplace = name.endswith("_") and not name.endswith("__")
    base = name[:-1] if inplace else name
    fn = TABLE.get(base)
    if fn is None:
        low.env[node] = _unknown(low, node, name)
    else:
        low.env[node] = fn(low, node)
    if inplace and isinstance(node.args[0], fx.Node):  # later readers see the mutated value
        low.env[node.args[0]] = low.env[node]


def _marked(low: Lowering, value: Value, tag: str) -> Value:
    """The value a mark names; a gradient already marked for another parameter gets its own
    copy (an LSTM's two bias gradients are one traced value, but each parameter's gradient is
    reduced on its own at run time, so the plan prices one reduction per parameter)."""
    if not tag.startswith("grad:"):
        return value
    if value.name in low.marked_grads:
        value = low.emit("copy", [value], [value.type])[0]
    low.marked_grads.add(value.name)
    return value


def _unknown(low: Lowering, node: fx.Node, name: str) -> Lowered:
    origin = low.origin()
    where = str(origin) or "an unknown module"
    warnings.warn(
        f"no lowering for aten op {name!r} (node {node.name}) at {where}; it will run "
        "replicated (add it to shardplan/frontend/torch/ops.py)",
        UnsupportedOpWarning,
        stacklevel=2,
    )
    types = low.result_types(node)
    if not types:
        return None
    results = iter(low.emit(f"aten.{name}", low.tensors(node.args), types, safe=True))
    val = node.meta.get("val")
    if not isinstance(val, (list, tuple)):
        return next(results)
    # None (or non-tensor) outputs keep their positions, so ``getitem`` indices stay right
    return [next(results) if isinstance(v, torch.Tensor) else None for v in val]


def add_input(low: Lowering, node: fx.Node, role: Role, path: str, module: str = "") -> None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        low.env[node] = None
        return
    hint = path.replace("#", "_") if path else node.name
    value = low.graph.add_input(hint, tensor_type(val), role, Origin(path=path, module=module))
    low.env[node] = value
