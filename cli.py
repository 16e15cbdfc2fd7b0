"""The ``shardplan`` command: plan a model from a shell, show a saved plan, list passes.

    shardplan plan examples/mlp_graph.py:make --mesh dp=2,tp=4 --cluster h100-sxm --out plan.json
    shardplan show plan.json
    shardplan passes

Exit codes: 0 success, 1 a ShardplanError (message on stderr, no traceback unless ``--debug``),
2 a usage error. torch and jax are imported only if the planned model needs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .ir import Graph, Mesh, ShardplanError

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
SPINNER_DELAY = 1.0
"""Seconds of planning before a progress spinner appears (quick plans print no spinner)."""


class CliError(ShardplanError):
    """A command-line problem found after parsing (missing file, bad factory result)."""


# -- argument types (argparse turns their ArgumentTypeError into exit code 2) -------------------
def parse_mesh(text: str) -> dict[str, int]:
    """``dp=2,tp=4`` -> ``{"dp": 2, "tp": 4}`` (major axis first)."""
    axes: dict[str, int] = {}
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        name = name.strip()
        if not sep or not name.isidentifier() or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"bad mesh {text!r}: write named axes with sizes, major first, like dp=2,tp=4"
            )
        if name in axes:
            raise argparse.ArgumentTypeError(f"bad mesh {text!r}: axis {name!r} appears twice")
        if int(size) < 1:
            raise argparse.ArgumentTypeError(f"bad mesh {text!r}: axis {name!r} has size 0")
        axes[name] = int(size)
    return axes


def parse_size(text: str) -> int:
    """Bytes from ``40GB`` (10^9), ``512MiB`` (2^20), ``24e9`` or ``1.5TB``."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: use a number with an optional unit, like 40GB, 512MiB or 24e9"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def parse_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bad time limit {text!r}: give seconds > 0, like 30")
    return value


# -- the parser ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardplan",
        description="Plan how to shard an ML model's computation over a device mesh.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = commands.add_parser(
        "plan", help="plan a model", description="Plan FILE.py's model and print the plan."
    )
    plan.add_argument(
        "target",
        metavar="FILE.py[:FACTORY]",
        help="a Python file and the function in it (default `make`) that returns an IR Graph "
        "or (model_or_fn, example_args)",
    )
    plan.add_argument("--mesh", type=parse_mesh, required=True, help="axes, major first: dp=2,tp=4")
    plan.add_argument(
        "--cluster", default="cpu-test", help="catalogue name (h100-sxm, a100-80gb...) or a file"
    )
    plan.add_argument("--memory-limit", type=parse_size, help="bytes per device: 40GB, 512MiB")
    plan.add_argument(
        "--time-limit", type=parse_seconds, default=30.0, help="solver seconds (default 30)"
    )
    plan.add_argument("--out", type=Path, help="also save the plan as JSON here")
    plan.add_argument("--print-ir", action="store_true", help="print the graph's text form first")
    plan.add_argument(
        "--full", action="store_true", help="print every input, op and reshard, not the summary"
    )

    show = commands.add_parser(
        "show", aliases=["explain"], help="print a saved plan", description="Print a plan file."
    )
    show.add_argument("plan_file", metavar="PLAN.json", type=Path)
    show.add_argument(
        "--full", action="store_true", help="print every input, op and reshard, not the summary"
    )

    commands.add_parser("passes", help="list the registered graph passes")
    _add_costmodel_commands(commands)
    return parser


# -- cost-model commands (calibrate, whatif; owned by the cost-model issue) ----------------------
def _add_costmodel_commands(commands: Any) -> None:
    cal = commands.add_parser("calibrate", help="fit efficiency factors from microbenchmarks")
    cal.add_argument("measurements", type=Path, help="JSON from bench/microbench_gpu.py")
    cal.add_argument("--cluster", help="catalogue cluster the numbers are relative to")
    cal.add_argument("--out", type=Path, help="write the calibration JSON here")
    what = commands.add_parser("whatif", help="sweep hardware parameters and re-plan")
    what.add_argument("target", metavar="FILE.py[:FACTORY]")
    what.add_argument("--mesh", type=parse_mesh, required=True)
    what.add_argument("--cluster", default="h100-sxm")
    what.add_argument(
        "--vary", action="append", required=True, metavar="PARAM=X,Y",
        help="e.g. link_bandwidth=0.5,1,2,4 (repeatable)",
    )  # fmt: skip
    what.add_argument("--repeat", type=int, default=1, help="multiply times (layers stood for)")
    what.add_argument("--plot", type=Path, help="write the PNG here")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .costmodel.calibration import fit

    calibration = fit(args.measurements, args.cluster)
    sys.stdout.write(calibration.to_json())
    if args.out is not None:
        args.out.write_text(calibration.to_json())
    return 0


def cmd_whatif(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .whatif import whatif

    vary = {}
    for item in args.vary:
        name, _, values = item.partition("=")
        try:
            vary[name] = [float(v) for v in values.split(",")]
        except ValueError:
            parser.error(f"argument --vary: {item!r} is not PARAM=X,Y,...")
    mesh = Mesh(args.mesh, cluster=_resolve_cluster(parser, args.cluster))
    model, example_args = _plan_arguments(load_target(args.target), args.target)
    result = whatif(model, *example_args, mesh=mesh, vary=vary, repeat=args.repeat, plot=args.plot)
    print(result.table())
    return 0


# -- commands -----------------------------------------------------------------------------------
def _resolve_cluster(parser: argparse.ArgumentParser, name: str) -> str:
    """A catalogue name stays; a path is loaded and registered; anything else is a usage error."""
    from .costmodel import get_cluster, load_cluster

    if Path(name).suffix in (".toml", ".json") and Path(name).exists():
        return load_cluster(name).name
    try:
        return get_cluster(name).name
    except ShardplanError as exc:
        parser.error(f"argument --cluster: {_message(exc)}")
        raise  # parser.error exits; this line is for type checkers


def load_target(target: str) -> Any:
    """Import FILE.py by path and call its factory."""
    path_text, _, factory_name = target.rpartition(":")
    if not path_text or not factory_name.isidentifier():
        path_text, factory_name = target, "make"
    path = Path(path_text)
    if not path.is_file():
        raise CliError(
            f"no such file: {path_text} (give a Python file, like examples/mlp_graph.py)"
        )
    module_name = f"_shardplan_target_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot import {path_text}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # let the file import its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.resolve().parent))
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise CliError(f"{path_text} has no function {factory_name!r} (write FILE.py:FACTORY)")
    return factory()


def _plan_arguments(made: Any, target: str) -> tuple[Any, tuple[Any, ...]]:
    """A factory returns a Graph, or (model_or_fn, example_args) with args a tuple or one value."""
    if isinstance(made, Graph):
        return made, ()
    if isinstance(made, tuple) and len(made) == 2:
        model, args = made
        return model, tuple(args) if isinstance(args, (tuple, list)) else (args,)
    raise CliError(
        f"the factory in {target} returned a {type(made).__name__}; return an IR Graph or "
        "(model_or_fn, example_args_tuple)"
    )


@contextmanager
def _progress(message: str) -> Iterator[None]:
    """A spinner on stderr, shown only on a terminal and only once planning passes a second."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    status = Console(stderr=True).status(message)
    timer = threading.Timer(SPINNER_DELAY, status.start)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        status.stop()


def _print_plan(plan: Any, full: bool = False) -> None:
    """The one-screen summary, or with ``full`` every table (in colour on a terminal);
    deterministic fixed-width text when piped."""
    from .solver.report import format_plan, plan_renderable

    if full and sys.stdout.isatty():
        from rich.console import Console

        Console().print(plan_renderable(plan))
    else:
        sys.stdout.write(format_plan(plan, full=full))


def cmd_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .api import plan as make_plan

    mesh = Mesh(args.mesh, cluster=_resolve_cluster(parser, args.cluster))
    model, example_args = _plan_arguments(load_target(args.target), args.target)
    if args.print_ir and isinstance(model, Graph):
        sys.stdout.write(str(model) + "\n")
    start = time.perf_counter()
    with _progress(f"planning {args.target} on {mesh}..."):
        plan = make_plan(
            model,
            *example_args,
            mesh=mesh,
            memory_limit=args.memory_limit,
            time_limit=args.time_limit,
        )
    if args.print_ir and not isinstance(model, Graph):
        sys.stdout.write(str(plan.graph) + "\n")
    _print_plan(plan, args.full)
    if args.out is not None:
        plan.save(args.out)
        print(f"saved {args.out} ({time.perf_counter() - start:.1f} s to plan)", file=sys.stderr)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from .solver.serialize import plan_from_json

    try:
        text = args.plan_file.read_text()
    except OSError as exc:
        raise CliError(f"cannot read {args.plan_file}: {exc.strerror or exc}") from None
    _print_plan(plan_from_json(text), args.full)
    return 0


def cmd_passes() -> int:
    from .passes import get_pass, list_passes

    for name in list_passes():
        print(f"{name:<24} {get_pass(name).summary}")
    return 0


def _message(exc: BaseException) -> str:
    """The error's own text (KeyError subclasses would otherwise print it quoted)."""
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardplan`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        match args.command:
            case "plan":
                return cmd_plan(args, parser)
            case "show" | "explain":
                return cmd_show(args)
            case "calibrate":
                return cmd_calibrate(args)
            case "whatif":
                return cmd_whatif(args, parser)
            case _:
                return cmd_passes()
    except SystemExit as exc:  # parser.error after parsing (unknown cluster)
        return int(exc.code or 0)
    except ShardplanError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"shardplan: error: {_message(exc)}", file=sys.stderr)
        if not args.debug:
            print("(run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
