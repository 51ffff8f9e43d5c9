"""The exceptions of ``producers``: one root, :class:`ProducerError`, grouped as httpx's ``_exceptions.py``.

    ProducerError
    ├── RolloutError                     (the rollout server's refusals, each with its HTTP status)
    │   ├── InvalidTask
    │   ├── TaskConflict
    │   ├── TaskNotFound
    │   ├── NotReady
    │   └── KafkaUnavailable
    ├── RuntimeFailed                    (where a session's harness runs)
    │   ├── RuntimeInitError
    │   └── GitError
    ├── HarnessInstallError              (also a RuntimeError)
    └── AdapterError                     (also a ValueError)

Each keeps the builtin it subclassed before as a second base, so ``except ValueError`` and the like still
catch it. The modules that raise them re-export them under their old names (``producers.rollout.errors``,
``producers.runtimes.base``, ``producers.runtimes.workspace``, ``producers.harness_install``,
``producers.adapters.base``). The gateway's private signal that a node let a session go is control flow,
not an error, and stays outside the tree.
"""

from __future__ import annotations


class ProducerError(Exception):
    """Base class for every error a producer (the rollout server, a gateway node, a runtime) raises."""


# Rollout errors: the rollout server refuses a task request; the app turns each into its HTTP answer.


class RolloutError(ProducerError):
    """Base class for the rollout server's refusals."""

    status_code: int = 500


class InvalidTask(RolloutError):
    """A task request that parsed but cannot be accepted (answered 422 with the field)."""

    status_code = 422

    def __init__(self, field: tuple[str, ...], message: str) -> None:
        super().__init__(f"{'.'.join(field)}: {message}")
        self.field = field
        self.message = message


class TaskConflict(RolloutError):
    """A task with this id was already accepted (409)."""

    status_code = 409


class TaskNotFound(RolloutError):
    """No task with this id was accepted (404)."""

    status_code = 404


class NotReady(RolloutError):
    """The server is still reading the log and cannot yet tell a new task id from an old one (503)."""

    status_code = 503


class KafkaUnavailable(RolloutError):
    """The task could not be written to Kafka; nothing of it was recorded (503)."""

    status_code = 503


# Runtime errors: the workspace or container a session's harness runs in failed.


class RuntimeFailed(ProducerError):
    """Base class for a runtime's failures; never raised itself."""


class RuntimeInitError(RuntimeFailed):
    """The runtime could not be prepared (checkout, set-up command, container start): an infrastructure
    failure of the session, not the policy's."""


class GitError(RuntimeFailed):
    """A git command failed; the message holds the command and its output tail."""


# Harness errors: the harness CLI or its agent spec cannot be run.


class HarnessInstallError(ProducerError, RuntimeError):
    """npm could not install a harness CLI, or the installed CLI does not run."""


class AdapterError(ProducerError, ValueError):
    """The agent spec cannot be run by this adapter (bad settings, bad template): the policy's fault is
    not involved; the session is refused before it starts."""


__all__ = ["AdapterError", "GitError", "HarnessInstallError", "InvalidTask", "KafkaUnavailable", "NotReady",
           "ProducerError", "RolloutError", "RuntimeFailed", "RuntimeInitError", "TaskConflict",
           "TaskNotFound"]
