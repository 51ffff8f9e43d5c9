"""Exceptions of the rollout server; the app turns each into its HTTP answer."""

from __future__ import annotations


class RolloutError(Exception):
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
