"""The exceptions of ``processors``: one root, :class:`ProcessorError`, grouped as httpx's ``_exceptions.py``.

    ProcessorError
    ├── BuildError
    │   ├── UnknownBuilder               (also a KeyError)
    │   ├── UnresolvedPromptDelta        (also a ValueError)
    │   ├── BuildFailed                  (also a RuntimeError)
    │   └── BuildProcessDied             (also a RuntimeError)
    ├── LogReadError                     (also a RuntimeError)
    └── FactError                        (also a ValueError)

Each keeps the builtin it subclassed before as a second base, so ``except ValueError`` and the like still
catch it. The modules that raise them re-export them under their old names (``processors.builders``,
``processors.trajectories.payloads``, ...).
"""

from __future__ import annotations


class ProcessorError(Exception):
    """Base class for every error a processor (a worker, a builder) raises."""


# Build errors: a session's records could not be made into a trajectory.


class BuildError(ProcessorError):
    """A session could not be built into a trajectory."""


class UnknownBuilder(BuildError, KeyError):
    """No builder is registered under that name."""


class UnresolvedPromptDelta(BuildError, ValueError):
    """A builder was given a completion whose prompt is a delta: resolve the session's prompts first."""


class BuildFailed(BuildError, RuntimeError):
    """A build raised in the build process; the message is its traceback."""


class BuildProcessDied(BuildError, RuntimeError):
    """A build process ended (or could not start) with jobs still to answer."""


# Log errors: the retained input topics could not be read back.


class LogReadError(ProcessorError, RuntimeError):
    """The log could not be read back now (broker unreachable, partition unknown, or offsets the worker
    has seen there not readable at the moment): the caller tries again later, never builds without them."""


# Record errors: an input record lacks what the worker needs from it.


class FactError(ProcessorError, ValueError):
    """A record's document lacks what a fact needs (the record is dead-lettered)."""


__all__ = ["BuildError", "BuildFailed", "BuildProcessDied", "FactError", "LogReadError", "ProcessorError",
           "UnknownBuilder", "UnresolvedPromptDelta"]
