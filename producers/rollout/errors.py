"""Exceptions of the rollout server; the app turns each into its HTTP answer. They live in
:mod:`producers.errors` under :class:`~producers.errors.ProducerError`; this module keeps their old path."""

from __future__ import annotations

from producers.errors import InvalidTask, KafkaUnavailable, NotReady, RolloutError, TaskConflict, TaskNotFound

__all__ = ["InvalidTask", "KafkaUnavailable", "NotReady", "RolloutError", "TaskConflict", "TaskNotFound"]
