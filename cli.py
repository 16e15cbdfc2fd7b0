"""The ``shardplan`` command: plan a model from a shell, show a saved plan, list passes.

    shardplan plan examples/mlp_graph.py:make --mesh dp=2,tp=4 --cluster h100-sxm --out plan.json
    shardplan plan bert.py --mesh dp=8 --input input_ids=8x128:int64 --input labels=8x128:int64
    shardplan show plan.json
    shardplan passes
    shardplan plan --print-passes

Exit codes: 0 success (also when a reader such as ``head`` closes the pipe early), 1 an error
(one line on stderr: a ShardplanError, or any exception raised by the user's file or model; the
traceback with ``--debug`` anywhere on the line), 2 a usage error, 130 interrupted (Ctrl-C).
torch and jax are imported only if the planned model needs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .api.checks import check_cluster
from .cli_inputs import (
    keyword_inputs,
    parse_input,
    parse_mesh,
    parse_pin,
    parse_seconds,
    parse_size,
)
from .ir import Graph, Mesh, ShardplanError, checks
from .ir.errors import CliError, UserCodeError
from .ir.printer import print_graph
from .solver import plan_files, progress

_TRACED_BRANCH = {
    "TracerBoolConversionError", "ConcretizationTypeError", "TracerIntegerConversionError",
}  # fmt: skip
"""JAX's errors for Python control flow on a traced value (matched by name: no jax import)."""


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, or the fix for a JAX ``if`` on a traced value."""
    name = type(exc).__name__
    if name in _TRACED_BRANCH:
        return (
            f"{name}: the function branches in Python on a traced JAX value (an `if`, `int()` "
            "or `bool()` on an array); use jnp.where or jax.lax.cond instead"
        )
    text = str(exc).strip().splitlines()
    return f"{name}: {text[0]}" if text else name


class _Once(argparse.Action):
    """An option that may be given once (a second ``--mesh`` would silently replace the first)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"argument {option_string}: given twice; give it once (like dp=2,tp=4)")
        setattr(namespace, self.dest, values)


class _PrintPasses(argparse.Action):
    """``--print-passes``: print the planner's default pipeline (the one ``plan`` runs) and
    exit, as ``--help`` does (no model or mesh needed)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        from .solver.planner_passes import default_pipeline, describe_pipeline

        print(describe_pipeline(default_pipeline()))
        parser.exit(0)


def _clusters_epilog() -> str:
    from .costmodel.cluster import known_clusters

    return (
        f"clusters: {', '.join(known_clusters())} (default {checks.DEFAULT_CLUSTER}), or a "
        ".toml/.json cluster file. --debug anywhere on the line shows tracebacks."
    )


def _add_input_option(command: Any) -> None:
    command.add_argument(
        "--input", action="append", type=parse_input, default=[], metavar="NAME=SHAPE[:DTYPE]",
        help="an example input of a torch model, passed to forward by name (repeatable): "
        "input_ids=8x128:int64 (dtype float32 by default); the factory may then return the "
        "model alone",
    )  # fmt: skip


def _command(commands: Any, name: str, summary: str, description: str, **kw: Any) -> Any:
    return commands.add_parser(
        name, help=summary, description=description, epilog=_clusters_epilog(),
        **kw,
    )  # fmt: skip


# -- the parser ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardplan",
        description="Plan how to shard an ML model's computation over a device mesh.",
        epilog=_clusters_epilog(),
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = _command(commands, "plan", "plan a model", "Plan FILE.py's model and print the plan.")
    plan.add_argument(
        "target",
        metavar="FILE.py[:FACTORY]",
        help="a Python file and the function in it (default `make`) that returns an IR Graph "
        "or (model_or_fn, example_args)",
    )
    plan.add_argument(
        "--mesh", type=parse_mesh, action=_Once, required=True, help="axes, major first: dp=2,tp=4"
    )
    plan.add_argument(
        "--cluster",
        default=checks.DEFAULT_CLUSTER,
        help=f"catalogue name (below) or a .toml/.json file (default {checks.DEFAULT_CLUSTER})",
    )
    plan.add_argument(
        "--memory-limit", type=parse_size, help="bytes per device: 40GB, 512MiB (default: the "
        "cluster's device memory)",
    )  # fmt: skip
    plan.add_argument(
        "--time-limit",
        type=parse_seconds,
        default=30.0,
        help="solver budget: seconds of search on an idle core (deterministic; default 30)",
    )
    plan.add_argument(
        "--out", type=Path, help="also save the plan as JSON here (checked before planning, "
        "written atomically)",
    )  # fmt: skip
    plan.add_argument(
        "--pin", action="append", type=parse_pin, default=[], metavar="KEY=DIMS[:pN]",
        help="fix a value's layout (repeatable): KEY a value name or parameter path, one dim "
        "per comma, '_' replicated, '+' between axes, ':p0' Shardy's priority (w1=_,tp)",
    )  # fmt: skip
    _add_input_option(plan)
    plan.add_argument(
        "--print-ir", action="store_true", help="print the graph with its pins propagated and "
        "each sharding's origin (pin, constraint, or the tensor it was propagated from)",
    )  # fmt: skip
    plan.add_argument(
        "--full", action="store_true", help="print every input, op and reshard, not the summary"
    )
    plan.add_argument(
        "--prefer", choices=("step", "throughput"), default="step",
        help="step: the fastest modelled step (default); throughput: the data-parallel plan "
        "when the fastest step leaves devices repeating the same work",
    )  # fmt: skip
    plan.add_argument(
        "--emit", choices=("plan", "torchtitan"), default="plan",
        help="plan: print the plan (default); torchtitan: print the nearest torchtitan "
        "configuration (overrides and a torchrun line), priced beside the plan",
    )  # fmt: skip
    plan.add_argument(
        "--flavor", help="with --emit torchtitan: torchtitan's model.flavor (debugmodel, 8B, 70B)"
    )
    plan.add_argument(
        "--passes", metavar="PIPELINE", help="the planner's pipeline instead of the default "
        "(--print-passes): pass names with {options}, comma-separated",
    )  # fmt: skip
    plan.add_argument(
        "--print-passes", action=_PrintPasses, help="print the default pipeline and exit"
    )
    plan.add_argument(
        "--quiet", "-q", action="store_true", help="no progress lines on stderr (by default each "
        "planning phase prints one, with the seconds since the start)",
    )  # fmt: skip

    show = _command(commands, "show", "print a saved plan", "Print a plan file.")
    show.add_argument("plan_file", metavar="PLAN.json", type=Path, help="saved by plan --out")
    show.add_argument(
        "--full", action="store_true", help="print every input, op and reshard, not the summary"
    )
    explain = _command(
        commands, "explain", "why a tensor has its layout",
        "Explain a plan's choice for one tensor: the chosen layout, the cheapest alternatives "
        "with their modelled compute / communication / memory difference, and what decided. "
        "Without NAME: the plan's summary, as show.",
    )  # fmt: skip
    explain.add_argument("plan_file", metavar="PLAN.json", type=Path, help="saved by plan --out")
    explain.add_argument(
        "name", metavar="NAME", nargs="?",
        help="a parameter path (model.layers.3.mlp.up_proj.weight) or a value name (%%mm_12)",
    )  # fmt: skip
    explain.add_argument("--full", action="store_true", help="without NAME: every table")

    report = _command(
        commands, "report", "write a saved plan as an HTML page",
        "Write a plan file as one self-contained HTML page (no network): mesh, layout map, "
        "memory against the budget, the two-stream step timeline, the pipeline schedule and a "
        "sortable table of reshards.",
    )  # fmt: skip
    report.add_argument("plan_file", metavar="PLAN.json", type=Path, help="saved by plan --out")
    report.add_argument(
        "-o", "--out", type=Path, required=True, metavar="PLAN.html",
        help="the page to write (checked first, written atomically)",
    )  # fmt: skip

    _command(commands, "passes", "list the registered graph passes", "List the graph passes.")
    _add_costmodel_commands(commands)
    _add_bench_commands(commands)
    return parser


def _add_bench_commands(commands: Any) -> None:
    text = "benchmark records (bench/*.py --record)"
    bench = _command(commands, "bench", text, "Work with " + text + ".")
    actions = bench.add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    compare = actions.add_parser(
        "compare", help="two records side by side: environment and result changes",
        description="Print what changed between two benchmark records (env, inputs, results).",
    )  # fmt: skip
    compare.add_argument("a", type=Path, help="the first record (JSON)")
    compare.add_argument("b", type=Path, help="the second record (JSON)")
    compare.add_argument("--changed", action="store_true", help="list only the results that differ")


def cmd_bench(args: argparse.Namespace) -> int:
    from .api.records import compare_records, load_record

    a, b = load_record(args.a), load_record(args.b)
    print(f"a: {args.a}\nb: {args.b}")
    print(compare_records(a, b, all_results=not args.changed))
    return 0


# -- cost-model commands (calibrate, whatif; owned by the cost-model issue) ----------------------
def _add_costmodel_commands(commands: Any) -> None:
    fit = "fit efficiency factors from microbenchmarks"
    cal = _command(commands, "calibrate", fit, fit[0].upper() + fit[1:] + ".")
    cal.add_argument("measurements", type=Path, help="JSON from bench/microbench_gpu.py")
    cal.add_argument("--cluster", help="catalogue cluster the numbers are relative to")
    cal.add_argument("--out", type=Path, help="write the calibration JSON here")
    sweep = "sweep hardware parameters and re-plan"
    what = _command(commands, "whatif", sweep, sweep[0].upper() + sweep[1:] + ".")
    what.add_argument("target", metavar="FILE.py[:FACTORY]", help="as for plan")
    _add_input_option(what)
    what.add_argument(
        "--mesh", type=parse_mesh, action=_Once, required=True, help="axes, major first: dp=2,tp=4"
    )
    what.add_argument(
        "--cluster", default=checks.DEFAULT_CLUSTER,
        help=f"catalogue name (below) or a .toml/.json file (default {checks.DEFAULT_CLUSTER})",
    )  # fmt: skip
    what.add_argument(
        "--vary", action="append", required=True, metavar="PARAM=X,Y",
        help="e.g. link_bandwidth=0.5,1,2,4 (repeatable)",
    )  # fmt: skip
    what.add_argument(
        "--repeat", type=int, default=1, help="multiply times by this (layers stood for; default 1)"
    )
    what.add_argument("--plot", type=Path, help="also write a PNG plot here")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .costmodel.calibration import fit

    if args.out is not None:
        plan_files.check_output_path(args.out)
    calibration = fit(args.measurements, args.cluster)
    sys.stdout.write(calibration.to_json())
    if args.out is not None:
        plan_files.atomic_write_text(args.out, calibration.to_json())
    return 0


def cmd_whatif(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .api.whatif import whatif

    vary = {}
    for item in args.vary:
        name, _, values = item.partition("=")
        try:
            vary[name] = [float(v) for v in values.split(",")]
        except ValueError:
            parser.error(f"argument --vary: {item!r} is not PARAM=X,Y,...")
    mesh = Mesh(args.mesh, cluster=_resolve_cluster(parser, args.cluster))
    model, example_args = _plan_arguments(load_target(args.target), args.target, args.input)
    named = keyword_inputs(args.input)
    result = whatif(
        model, *example_args, mesh=mesh, vary=vary, repeat=args.repeat, plot=args.plot, **named
    )
    print(result.table())
    return 0


# -- commands -----------------------------------------------------------------------------------
def _resolve_cluster(parser: argparse.ArgumentParser, name: str) -> str:
    """A catalogue name stays; a path is loaded and registered; anything else is a usage error."""
    from .costmodel import load_cluster

    if Path(name).suffix in (".toml", ".json") and Path(name).exists():
        return load_cluster(name).name
    try:
        return check_cluster(name)
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
    except Exception as exc:
        raise UserCodeError(f"importing {path_text} failed: {_one_line(exc)}") from exc
    finally:
        sys.path.remove(str(path.resolve().parent))
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise CliError(f"{path_text} has no function {factory_name!r} (write FILE.py:FACTORY)")
    try:
        return factory()
    except Exception as exc:
        raise UserCodeError(f"{path_text}:{factory_name}() failed: {_one_line(exc)}") from exc


def _plan_arguments(made: Any, target: str, named: Sequence = ()) -> tuple[Any, tuple[Any, ...]]:
    """A factory returns a Graph, or (model_or_fn, example_args) with args a tuple or one value;
    with ``--input`` (``named``) a model alone too."""
    if isinstance(made, Graph):
        if named:
            raise CliError(f"--input is for a torch model; {target} made an IR Graph")
        return made, ()
    if named and not isinstance(made, tuple):
        return made, ()
    if isinstance(made, tuple) and len(made) == 2:
        model, args = made
        return model, tuple(args) if isinstance(args, (tuple, list)) else (args,)
    raise CliError(
        f"the factory in {target} returned a {type(made).__name__}; return an IR Graph or "
        "(model_or_fn, example_args_tuple)"
    )


def propagated_ir(graph: Graph) -> str:
    """The graph's text with its pins propagated (``passes/propagate.py``) and each sharding's
    origin in a comment; the graph is left as it was (the plan keeps it)."""
    from .passes.propagate import propagate

    saved = [(v, v.sharding, v.sharding_origin) for v in graph.values()]
    try:
        for value in graph.values():
            if not value.pinned:
                value.sharding = None
        propagate(graph)
        return print_graph(graph, origins=True)
    finally:
        for value, sharding, why in saved:
            value.sharding, value.sharding_origin = sharding, why


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
    from .api.plan import plan as make_plan

    if args.out is not None:
        plan_files.check_output_path(args.out)  # before minutes of planning, not after
    mesh = Mesh(args.mesh, cluster=_resolve_cluster(parser, args.cluster))
    start = time.perf_counter()
    with progress.planning(verbose=not args.quiet):
        model, example_args = _plan_arguments(load_target(args.target), args.target, args.input)
        progress.report("load", "%s built the model (%.1f s)", args.target, progress.elapsed())
        named = keyword_inputs(args.input)
        try:
            plan = make_plan(
                model,
                *example_args,
                mesh=mesh,
                memory_limit=args.memory_limit,
                time_limit=args.time_limit,
                pins=dict(args.pin) or None,
                prefer=args.prefer,
                passes=args.passes,
                **named,
            )
        except ShardplanError:
            raise
        except Exception as exc:  # the user's model raised while it was captured
            raise UserCodeError(f"planning {args.target} failed: {_one_line(exc)}") from exc
    if args.out is not None:  # saved first: a reader closing the pipe (| head) stops the print
        plan_files.atomic_write_text(args.out, plan.to_json())
        print(f"saved {args.out} ({time.perf_counter() - start:.1f} s to plan)", file=sys.stderr)
    if args.print_ir:
        sys.stdout.write(propagated_ir(plan.graph) + "\n")
    if args.emit == "torchtitan":
        return _print_torchtitan(plan, args.flavor)
    _print_plan(plan, args.full)
    return 0


def _print_torchtitan(plan: Any, flavor: str | None) -> int:
    """The plan's torchtitan configuration, both modelled steps, and the launch line."""
    from .api.torchtitan import to_torchtitan

    emission = to_torchtitan(plan, flavor=flavor)
    print(emission.report())
    print("command        " + emission.config.command())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from .solver.serialize import plan_from_json

    plan = plan_from_json(plan_files.read_plan_text(args.plan_file))
    if getattr(args, "name", None):
        print(plan.explain(args.name))
    else:
        _print_plan(plan, args.full)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .solver.html_report import write_html
    from .solver.serialize import plan_from_json

    plan_files.check_output_path(args.out)
    plan = plan_from_json(plan_files.read_plan_text(args.plan_file))
    write_html(plan, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def cmd_passes() -> int:
    from .passes import get_pass, list_passes

    for name in list_passes():
        print(f"{name:<24} {get_pass(name).summary}")
    from .solver.planner_passes import default_pipeline, describe_pipeline

    print("\nthe planner's default pipeline (shardplan plan --passes replaces it):")
    print(describe_pipeline(default_pipeline()))
    return 0


def _message(exc: BaseException) -> str:
    """The error's own text (KeyError subclasses would otherwise print it quoted)."""
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardplan`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # anywhere: before or after the subcommand
    argv = [arg for arg in argv if arg != "--debug"]
    try:
        return _run(argv, debug)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("shardplan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `shardplan show plan.json | head`: the reader left; not an error
        _silence_stdout()
        return 0


def _run(argv: list[str], debug: bool) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        code = _dispatch(args, parser)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, not at exit
        return code
    except SystemExit as exc:  # parser.error after parsing (unknown cluster)
        return int(exc.code or 0)
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as exc:
        if debug:
            traceback.print_exc()
        # a ShardplanError in its own words (a parse error shows a caret line); anything else,
        # and errors of the user's code, as one line with the traceback on request
        text = _message(exc) if isinstance(exc, ShardplanError) else _one_line(exc)
        traced = isinstance(exc, UserCodeError) or not isinstance(exc, ShardplanError)
        hint = " (run with --debug for the traceback)" if traced and not debug else ""
        print(f"shardplan: error: {text}{hint}", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    match args.command:
        case "plan":
            return cmd_plan(args, parser)
        case "show" | "explain":
            return cmd_show(args)
        case "report":
            return cmd_report(args)
        case "calibrate":
            return cmd_calibrate(args)
        case "whatif":
            return cmd_whatif(args, parser)
        case "bench":
            return cmd_bench(args)
        case _:
            return cmd_passes()


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
