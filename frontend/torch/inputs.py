"""Example inputs of a torch model, bound by its ``forward``'s signature.

``sp.plan(model, *args, **kwargs)`` takes the inputs the way the model is called:
positionally, by keyword (HF style ``input_ids=ids, labels=ids``), mixed, or as one dict of
keyword arguments (``{"input_ids": ids, "labels": ids}``; a trailing dict whose keys are all
``forward`` parameters not given positionally counts as keywords too). Each argument may be a
pytree: nested tuples, lists (namedtuples kept), dicts and dataclasses of tensors, with
``None``, numbers, strings, dtypes and devices as constant leaves.

Every tensor leaf is one graph input named by its path in the call: the ``forward`` parameter
it binds to, then the pytree steps (``input_ids``, ``xs[1]``, ``batch['labels']``,
``batch.mask``). ``plan.apply``'s root hook binds each run-time call the same way, so a planned
model may be called positionally or by keyword, whatever the example call did.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ...ir.errors import ArgumentError

_CONSTANTS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    enum.Enum,
)
"""Non-tensor leaves passed to ``forward`` as they are (not graph inputs)."""

LeafFn = Callable[[str, torch.Tensor], Any]


def forward_signature(model: nn.Module) -> inspect.Signature | None:
    """``model.forward``'s signature (``self`` bound), or None when Python cannot read it."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def named_parameters(signature: inspect.Signature) -> list[str]:
    """Parameters that can be passed by name (not ``*args`` / ``**kwargs``)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in signature.parameters.values() if p.kind in kinds]


def takes_any_keyword(signature: inspect.Signature) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())


def accepts_keyword(model: nn.Module, key: str) -> bool:
    """Whether ``key`` may be an example keyword input of ``model`` (a ``forward`` parameter,
    or any name when ``forward`` takes ``**kwargs`` and ``key`` is no near miss of one)."""
    signature = forward_signature(model)
    if signature is None:
        return True
    names = named_parameters(signature)
    if key in names:
        return True
    return takes_any_keyword(signature) and not did_you_mean(key, names)


def did_you_mean(name: str, known: list[str]) -> str:
    """`` did you mean 'x'?`` for a near miss of a ``forward`` parameter, else ``""``."""
    folded = [k for k in known if k.lower() == name.lower()]
    close = folded or difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" did you mean {close[0]!r}?" if close else ""


# -- binding --------------------------------------------------------------------------------
def bind(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """The example call ``(args, kwargs)`` checked against ``forward``: a trailing dict of
    keyword arguments folded into ``kwargs``; an error naming the argument and the fix for an
    extra positional, an unknown or repeated keyword, a missing argument or a bad leaf."""
    signature = forward_signature(model)
    args, kwargs = _fold_keyword_dict(signature, tuple(args), dict(kwargs))
    if signature is not None:
        _check_binding(model, signature, args, kwargs)
    for path, value in argument_paths(signature, args, kwargs):
        _check_leaves(model, value, path)
    return args, kwargs


def _fold_keyword_dict(
    signature: inspect.Signature | None, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """A last positional dict is keywords when its keys are ``forward`` parameters that no
    positional fills (``sp.plan(bert, {"input_ids": ids, "labels": ids})``)."""
    if not args or not isinstance(args[-1], Mapping) or not args[-1]:
        return args, kwargs
    last = args[-1]
    if not all(isinstance(k, str) for k in last):
        return args, kwargs
    if signature is not None:
        names = named_parameters(signature)
        taken = set(names[: len(args) - 1])
        known = all(k in names or takes_any_keyword(signature) for k in last)
        if not known or taken & set(last) or _unfilled(signature, len(args) - 1, {*last, *kwargs}):
            return args, kwargs
    elif len(args) > 1:
        return args, kwargs
    twice = sorted(set(last) & set(kwargs))
    if twice:
        raise ArgumentError(
            f"example input {twice[0]!r} is given twice (in the dict and as {twice[0]}=)"
        )
    return args[:-1], {**last, **kwargs}


def _unfilled(signature: inspect.Signature, given: int, keys: set) -> list[str]:
    """Required parameters that neither the first ``given`` positionals nor ``keys`` fill:
    then a trailing dict is that positional input (``forward(self, batch, **kwargs)``)."""
    params = list(signature.parameters.values())
    return [
        p.name
        for p in params[given:]
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and p.name not in keys
    ]


def _check_binding(
    model: nn.Module, signature: inspect.Signature, args: tuple, kwargs: dict
) -> None:
    where = f"{type(model).__name__}.forward{_short(signature)}"
    names = named_parameters(signature)
    var_positional = any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()
    )
    positional = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if len(args) > len(positional) and not var_positional:
        extra = len(args) - len(positional)
        raise ArgumentError(
            f"{where} takes {len(positional)} positional input(s) but {len(args)} example "
            f"inputs were given; {extra} too many. A target only the loss reads goes in "
            "loss_inputs=(y,) with loss_fn=fn(output, y); other inputs go by name "
            f"({', '.join(n + '=' for n in names[:4]) or 'no names'})"
        )
    star = next((p.name for p in signature.parameters.values()
                 if p.kind is inspect.Parameter.VAR_KEYWORD), "kwargs")  # fmt: skip
    typed = typed_keywords(model) if takes_any_keyword(signature) else None
    for key, value in kwargs.items():
        if key in names:
            continue
        hint = did_you_mean(key, names)
        if hint or not takes_any_keyword(signature):
            raise ArgumentError(
                f"{where} has no parameter {key!r};{hint or ''} it takes {', '.join(names)}"
            )
        _check_keyword_value(model, key, value, typed, star, names)
    for name in positional[: len(args)]:
        if name in kwargs:
            raise ArgumentError(
                f"example input {name!r} is given twice: positionally and as {name}=; give it once"
            )
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ArgumentError(f"{where}: {exc}; give it as an example input") from None


def check_read(model: nn.Module, args: tuple, kwargs: Mapping[str, Any], read: Callable) -> None:
    """A keyword that no ``forward`` parameter names, taken by its ``**kwargs``, whose tensors
    the traced step never reads (``read(path)`` is False for each): an error naming it.

    Hugging Face models take ``**kwargs`` and pass them on to attention and the loss, which
    read only the names they know; an unknown (misspelt) keyword is dropped on the way
    without a word, so the plan would price a step without it and ``apply`` would split a
    tensor nothing uses. Non-tensor keywords (``output_attentions=True``) are not checked."""
    signature = forward_signature(model)
    if signature is None or not takes_any_keyword(signature):
        return
    args, kwargs = _fold_keyword_dict(signature, tuple(args), dict(kwargs))
    names = named_parameters(signature)
    star = next(p.name for p in signature.parameters.values()
                if p.kind is inspect.Parameter.VAR_KEYWORD)  # fmt: skip
    for key, value in kwargs.items():
        tensors = tree_tensors(value, key)
        if key in names or not tensors or any(read(path) for path, _ in tensors):
            continue
        raise ArgumentError(
            f"example input {key!r} goes to {type(model).__name__}.forward's **{star} (no "
            f"parameter names it), and the model never reads it; leave it out or name a "
            f"parameter forward takes: {', '.join(names)}"
        )


def typed_keywords(model: nn.Module) -> set[str] | None:
    """The keys ``forward``'s ``**kwargs: Unpack[SomeTypedDict]`` declares (Hugging Face's
    ``TransformersKwargs``), or None when ``**kwargs`` is untyped or its hints cannot be read."""
    import typing

    try:
        hints = typing.get_type_hints(model.forward, include_extras=True)
    except Exception:
        return None
    signature = forward_signature(model)
    star = next((p.name for p in (signature.parameters.values() if signature else ())
                 if p.kind is inspect.Parameter.VAR_KEYWORD), None)  # fmt: skip
    hint = hints.get(star or "")
    if typing.get_origin(hint) is not typing.Unpack:
        return None
    declared = typing.get_args(hint)[0]
    keys = getattr(declared, "__required_keys__", set()) | getattr(
        declared, "__optional_keys__", set()
    )
    return set(keys) or None


def _check_keyword_value(
    model: nn.Module, key: str, value: Any, typed: set[str] | None, star: str, names: list[str]
) -> None:
    """A shardplan object given as a model keyword (``strategy=`` is ``sp.evaluate``'s, not
    ``sp.plan``'s), or a keyword a typed ``**kwargs`` does not declare: an error naming it."""
    model_name = type(model).__name__
    if type(value).__module__.split(".")[0] == "shardplan":
        hint = (
            "; to price a hand-written strategy call sp.evaluate(model, ..., mesh=mesh, "
            "strategy=...), or pin its layouts with sp.plan(..., pins=...)"
            if key == "strategy"
            else ""
        )
        raise ArgumentError(
            f"{key}= is a shardplan {type(value).__name__}, not an input of {model_name}.forward "
            f"(which would take it through **{star}): sp.plan has no {key}= keyword{hint}"
        )
    if typed is not None and key not in typed:
        close = difflib.get_close_matches(key, sorted(typed) + names, n=1)
        raise ArgumentError(
            f"example input {key!r} goes to {model_name}.forward's **{star}, which declares only "
            f"{', '.join(sorted(typed))}; forward's parameters are {', '.join(names)}"
            + (f"; did you mean {close[0]!r}?" if close else "; leave it out")
        )


def _short(signature: inspect.Signature) -> str:
    text = str(signature)
    return text if len(text) <= 80 else text[:76] + "...)"


def argument_paths(
    signature: inspect.Signature | None, args: tuple, kwargs: Mapping[str, Any]
) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of each argument of the call, named by the parameter it binds to."""
    params = list(signature.parameters.values()) if signature is not None else []
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    star = next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), "args")
    for i, value in enumerate(args):
        name = positional[i].name if i < len(positional) else f"{star}[{i - len(positional)}]"
        yield name, value
    yield from kwargs.items()


# -- pytrees ---------------------------------------------------------------------------------
def _check_leaves(model: nn.Module, tree: Any, path: str) -> None:
    for leaf_path, leaf in _leaves(tree, path):
        if isinstance(leaf, (torch.Tensor, *_CONSTANTS)):
            continue
        kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
        fix = "convert it with torch.as_tensor(...)" if hasattr(leaf, "__array__") else (
            "pass tensors (in tuples, lists, dicts or dataclasses), None, numbers or strings"
        )  # fmt: skip
        raise ArgumentError(
            f"example input {leaf_path} of {type(model).__name__} is a {kind}, not a tensor; {fix}"
        )


def _leaves(tree: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every leaf of ``tree`` with its path (tensors and everything else)."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, (tuple, list)):
        for i, item in enumerate(tree):
            yield from _leaves(item, f"{path}[{i}]")
    elif isinstance(tree, Mapping):
        for key, item in tree.items():
            yield from _leaves(item, f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            yield from _leaves(getattr(tree, f.name), f"{path}.{f.name}")
    elif is_jagged(tree):
        for name, t in _jagged_tensors(tree).items():
            yield f"{path}.{name}", t
    else:
        yield path, tree


def is_jagged(tree: Any) -> bool:
    """A torchrec ``KeyedJaggedTensor`` (duck-typed: torchrec is not imported for it)."""
    return type(tree).__name__ == "KeyedJaggedTensor" and hasattr(tree, "offset_per_key")


def _jagged_tensors(kjt: Any) -> dict[str, torch.Tensor]:
    """A ``KeyedJaggedTensor``'s tensors: its values, lengths and (weighted) weights."""
    out = {"values": kjt.values(), "lengths": kjt.lengths()}
    if kjt.weights_or_none() is not None:
        out["weights"] = kjt.weights()
    return out


def _map_jagged(kjt: Any, path: str, fn: LeafFn) -> Any:
    """The ``KeyedJaggedTensor`` rebuilt from ``fn`` of its tensors. Its per-key counts and
    offsets are the example's (Python ints): torchrec would otherwise read them from the
    lengths (``.tolist()``), which a trace on fake tensors cannot; the captured step is then
    for batches of these per-key counts, as a traced step is for its example's shapes."""
    tensors = {name: fn(f"{path}.{name}", t) for name, t in _jagged_tensors(kjt).items()}
    return type(kjt)(
        keys=kjt.keys(), values=tensors["values"], lengths=tensors["lengths"],
        weights=tensors.get("weights"), stride=kjt.stride(),
        length_per_key=kjt.length_per_key(), offset_per_key=kjt.offset_per_key(),
    )  # fmt: skip


def tree_tensors(tree: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of every tensor leaf of one pytree."""
    return [(p, leaf) for p, leaf in _leaves(tree, path) if isinstance(leaf, torch.Tensor)]


def map_tree(tree: Any, path: str, fn: LeafFn) -> Any:
    """``tree`` with each tensor leaf replaced by ``fn(path, tensor)`` (containers rebuilt)."""
    return _map(tree, path, fn)


def tensor_leaves(
    args: tuple, kwargs: Mapping[str, Any], signature: Any
) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of every tensor in the call, in call order (positional, keywords)."""
    return [
        (leaf_path, leaf)
        for name, value in argument_paths(signature, args, kwargs)
        for leaf_path, leaf in _leaves(value, name)
        if isinstance(leaf, torch.Tensor)
    ]


def map_tensors(
    args: tuple, kwargs: Mapping[str, Any], signature: Any, fn: LeafFn
) -> tuple[tuple, dict]:
    """The call with each tensor leaf replaced by ``fn(path, tensor)`` (containers rebuilt)."""
    named = list(argument_paths(signature, args, kwargs))
    new_args = tuple(_map(value, name, fn) for name, value in named[: len(args)])
    new_kwargs = {key: _map(value, key, fn) for key, value in named[len(args) :]}
    return new_args, new_kwargs


def _map(tree: Any, path: str, fn: LeafFn) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    if isinstance(tree, (tuple, list)):
        items = [_map(item, f"{path}[{i}]", fn) for i, item in enumerate(tree)]
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
            return type(tree)(*items)
        return type(tree)(items)
    if isinstance(tree, Mapping):
        out = dict(tree) if type(tree) is dict else _copy_mapping(tree)
        for key, item in tree.items():
            out[key] = _map(item, f"{path}[{key!r}]", fn)
        return out
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {
            f.name: _map(getattr(tree, f.name), f"{path}.{f.name}", fn)
            for f in dataclasses.fields(tree)
            if f.init
        }
        return dataclasses.replace(tree, **changes)
    if is_jagged(tree):
        return _map_jagged(tree, path, fn)
    return tree


def _copy_mapping(tree: Mapping) -> Any:
    """A shallow copy of a dict-like container of the same type (HF ``BatchEncoding``)."""
    import copy

    try:
        return copy.copy(tree)
    except Exception:  # an unusual mapping: a plain dict carries the same call
        return dict(tree)


def example_tensor(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """A CLI example input (``--input input_ids=8x128:int64``): zeros of an integer or bool
    dtype (valid token ids), normal samples of a floating one; planning reads only the shape."""
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise ArgumentError(
            f"unknown dtype {dtype!r}; use a torch dtype name like int64, float32 or bfloat16"
        )
    if kind.is_floating_point:
        return torch.randn(shape, dtype=kind)
    return torch.zeros(shape, dtype=kind)


def capture_hint(exc: BaseException) -> str:
    """The fix for a trace failure a user can cause from the call, else the generic hint."""
    text = str(exc)
    if "FakeTensor" in text and "convert" in text:
        return (
            "hint: a real tensor reached the trace from outside the example inputs (a closure "
            "or global in forward or loss_fn); pass it as an input: by name to forward, or "
            "loss_inputs=(y,) for a target only loss_fn reads"
        )
    return "hint: the forward must run on fake tensors (no data-dependent Python control flow)"


def check_loss_inputs(loss_fn: Any, loss_inputs: Any) -> tuple:
    """``loss_inputs`` as a tuple; it needs a ``loss_fn`` to read it."""
    if loss_inputs is None:
        return ()
    if loss_fn is None:
        raise ArgumentError(
            "loss_inputs= are passed to loss_fn(output, *loss_inputs); give loss_fn= too"
        )
    if not isinstance(loss_inputs, (tuple, list)):
        loss_inputs = (loss_inputs,)
    return tuple(loss_inputs)


__all__ = [
    "accepts_keyword",
    "bind",
    "capture_hint",
    "check_loss_inputs",
    "check_read",
    "example_tensor",
    "forward_signature",
    "map_tensors",
    "map_tree",
    "named_parameters",
    "tensor_leaves",
    "tree_tensors",
]
