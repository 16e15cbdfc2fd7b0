"""Say why a model could not be traced, in the user's terms (the op, where, and the fix)."""

from __future__ import annotations

import linecache
import os
from types import TracebackType

_DATA_DEPENDENT = ("DataDependentOutputException", "GuardOnDataDependentSymNode")
_GENERIC = "hint: the forward must run on fake tensors (no data-dependent Python control flow)"


def trace_failure(model: object, exc: BaseException, hint: str = _GENERIC) -> str:
    """The message of a failed ``make_fx`` trace of ``model``: the cause, and for a read of a
    tensor's value (``aten._local_scalar_dense``: ``.item()``, ``if t.max() > n``, a shape that
    depends on values) the model line that made it and how to plan around it; else ``hint``."""
    name = type(model).__name__
    cause = f"{type(exc).__name__}: {exc}"
    if type(exc).__name__ not in _DATA_DEPENDENT:
        return f"could not trace {name} with make_fx ({cause}); {hint}"
    where = _model_frame(exc.__traceback__)
    return (
        f"could not trace {name} with make_fx: {_op(str(exc))} reads a tensor's value in Python "
        f"({'at ' + where if where else 'in the forward'}); the planner traces with fake "
        "tensors, which have shapes but no values. hint: give example inputs that skip that "
        "code (for a loss computed from `labels` inside forward, e.g. Hugging Face CTC models: "
        "leave `labels` out and pass `loss_fn=` computing the loss from the output), or make "
        f"the value static in the model ({cause})"
    )


def _op(message: str) -> str:
    for word in message.replace("(", " ").replace(")", " ").replace(",", " ").split():
        if word.startswith("aten."):
            return word.rstrip(".:")
    return "an op"


def _model_frame(tb: TracebackType | None) -> str:
    """``file:line in Class.function: `source` `` of the innermost frame outside torch and
    shardplan (the model's own code), or '' when there is none."""
    found = ""
    while tb is not None:
        code = tb.tb_frame.f_code
        path = os.path.abspath(code.co_filename)
        if not path.startswith(_TORCH_DIR) and not _is_shardplan(path):
            line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            short = os.sep.join(path.split(os.sep)[-3:])
            qualname = getattr(code, "co_qualname", code.co_name)
            found = f"{short}:{tb.tb_lineno} in {qualname}: `{line}`"
        tb = tb.tb_next
    return found


def _is_shardplan(path: str) -> bool:
    """Whether ``path`` is shardplan's own code: a module at the package root or in one of its
    layers (a virtual environment or tests inside a checkout are not)."""
    if not path.startswith(_SHARDPLAN_DIR + os.sep):
        return False
    parts = os.path.relpath(path, _SHARDPLAN_DIR).split(os.sep)
    return len(parts) == 1 or parts[0] in _SHARDPLAN_LAYERS


def _package_dir(module: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None and spec.origin else ""
    return os.path.dirname(os.path.abspath(origin)) if origin else "\0"


_TORCH_DIR = _package_dir("torch")
_SHARDPLAN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SHARDPLAN_LAYERS = ("frontend", "ir", "passes", "costmodel", "solver", "data")
