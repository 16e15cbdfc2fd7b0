"""The error hierarchy: every failure a user can see is a ShardplanError with a hint.

Every class deriving ``ShardplanError`` is defined here, grouped by the kind of problem; the
modules that raise them import them from here (``tests/ir/test_errors.py`` checks both).
Classes that callers may catch as a ``ValueError`` or ``KeyError`` derive from it too.

    ShardplanError
    ├── InputError                 the caller's input: arguments, names, commands, passes
    │   ├── ArgumentError          (ValueError) a bad argument of a public function
    │   │   ├── StrategyError      a hand-written ParallelStrategy that is malformed or misfits
    │   │   └── PipelineError      a pipeline schedule, stage count or chunks that cannot run
    │   ├── UnknownNameError       (KeyError) a name that is not known
    │   │   └── UnknownTensorError a value name or origin path not in the plan
    │   ├── PassError              a pass, pass pipeline or pass option that is malformed
    │   └── CliError               a command-line problem found after parsing
    │       └── UserCodeError      the user's file, factory or model raised
    ├── IRError                    the IR itself
    │   ├── IRVerifyError          a broken IR invariant
    │   └── IRParseError           text form that does not parse
    ├── ShardingError              a sharding that is malformed or does not fit a shape
    │   └── ContextParallelError   (ValueError) a sequence split with no balanced order
    ├── InfeasiblePlanError        no plan satisfies the constraints
    │   └── NoPlanInTime           the solver found none within its time limit
    ├── FrontendError              capture or emission by a framework binding
    ├── ConfigError                a configuration: cluster, tables, torchtitan, predictor
    │   ├── ClusterConfigError     a cluster file or description
    │   ├── UnknownClusterError    (UnknownNameError) a cluster name not in the catalogue
    │   ├── TableSpecError         an embedding table or dense-part description
    │   ├── TitanConfigError       (ValueError) a torchtitan configuration it would refuse
    │   └── PredictorError         the predictor's dependencies or model file
    └── FileFormatError            a file shardplan wrote, read back
        ├── PlanFileError          a plan file (Plan.save, ``shardplan plan --out``)
        └── RecordError            a benchmark record (record.schema.json)
"""

from __future__ import annotations


class ShardplanError(Exception):
    """Base of every error shardplan raises on purpose (never a stack trace from deep inside)."""


# -- input and arguments ---------------------------------------------------------------------
class InputError(ShardplanError):
    """The caller's input is wrong (an argument, a name, a command line, a pass pipeline)."""


class ArgumentError(InputError, ValueError):
    """A public function got a bad argument: wrong type, out of range, an unknown name or
    keyword; the one-line message names the argument, the value and the fix."""


class StrategyError(ArgumentError):
    """A hand-written ``ParallelStrategy``'s arguments are malformed or do not match the mesh."""


class PipelineError(ArgumentError):
    """A pipeline-parallel request cannot run: schedule, stages, chunks or micro-batches."""


class UnknownNameError(InputError, KeyError):
    """A name is not known; the message lists the known names (a ``KeyError`` too)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownTensorError(UnknownNameError):
    """``explain`` or a plan was given a name that is neither a value nor an origin path."""


class PassError(InputError):
    """A pass, a pass pipeline or a pass option is malformed (name, options, braces)."""


class CliError(InputError):
    """A command-line problem found after parsing (missing file, bad factory result)."""


class UserCodeError(CliError):
    """The user's FILE.py, its factory or the model raised; the cause is chained (``--debug``)."""


# -- the IR ----------------------------------------------------------------------------------
class IRError(ShardplanError):
    """The IR itself is wrong: a broken invariant or text that does not parse."""


class IRVerifyError(IRError):
    """The graph breaks an IR invariant (types, shardings, use lists, rule arity)."""


class IRParseError(IRError):
    """The text form could not be parsed; the message shows line:column and a caret."""


# -- sharding --------------------------------------------------------------------------------
class ShardingError(ShardplanError):
    """A sharding is malformed or does not fit a shape (indivisible, axis twice, unknown axis)."""


class ContextParallelError(ShardingError, ValueError):
    """A sequence split has no balanced head-tail order (lengths, chunks or split sizes)."""


# -- infeasible plans ------------------------------------------------------------------------
class InfeasiblePlanError(ShardplanError):
    """No plan satisfies the constraints (memory budget, pins); says the minimum needed."""


class NoPlanInTime(InfeasiblePlanError):
    """CP-SAT found no plan within the time limit (none was proven not to fit)."""


# -- frontends -------------------------------------------------------------------------------
class FrontendError(ShardplanError):
    """The model or function could not be captured or emitted by a framework binding."""


# -- configuration ---------------------------------------------------------------------------
class ConfigError(ShardplanError):
    """A configuration is wrong: a cluster, embedding tables, torchtitan, the predictor."""


class ClusterConfigError(ConfigError):
    """A cluster file could not be read or has missing / unknown / badly typed fields."""


class UnknownClusterError(ConfigError, UnknownNameError):
    """A cluster name is not in the catalogue; the message lists the known names."""


class TableSpecError(ConfigError):
    """A table description is malformed (rows, dim, pooling factor, dtype)."""


class TitanConfigError(ConfigError, ValueError):
    """A torchtitan configuration that torchtitan would refuse (the message names the fix)."""


class PredictorError(ConfigError):
    """The predictor cannot be used: scikit-learn missing, or a model file of another version."""


# -- files -----------------------------------------------------------------------------------
class FileFormatError(ShardplanError):
    """A file shardplan writes could not be read back: a plan file or a benchmark record."""


class PlanFileError(FileFormatError):
    """Not a plan file, a newer format version, or a plan this build cannot read."""


class RecordError(FileFormatError):
    """A benchmark record could not be read, or does not match ``record.schema.json``."""


# -- warnings --------------------------------------------------------------------------------
class UnsupportedOpWarning(UserWarning):
    """An op has no sharding rule; it was given the safe all-need-replication rule."""


class IdleAxisWarning(UserWarning):
    """A mesh axis splits nothing in the plan (e.g. ``dp=3`` with a batch of 8): its devices
    repeat the others' work. The message names the axis and a batch size that would use it."""


class IdleDevicesWarning(IdleAxisWarning):
    """The plan leaves devices repeating the same work although the batch could be split
    (a tiny model: every op at the kernel floor, or communication dearer than the compute a
    split saves). The message gives the modelled reason with its numbers and both step times;
    ``sp.plan(..., prefer="throughput")`` returns the data-parallel plan instead."""
