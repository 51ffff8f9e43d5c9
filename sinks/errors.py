"""The exceptions of ``sinks``: one root, :class:`SinkError`, grouped as httpx's ``_exceptions.py``.

    SinkError
    ├── FeedError                        (the trainer feed cannot go on)
    ├── BudgetError                      (also a ValueError)
    └── TrainerError                     (the trainer cannot go on)
        └── PolicyApiError

A trainer that wants to catch "the feed or the trainer failed" catches :class:`SinkError`. Each keeps the
builtin it subclassed before as a second base, so ``except ValueError`` still catches a budget error. The
modules that raise them re-export them under their old names (``sinks.feed``, ``sinks.batching``,
``sinks.trainer``).
"""

from __future__ import annotations


class SinkError(Exception):
    """Base class for every error a sink (the trainer feed, the trainer, the exports) raises."""


# Feed errors: the trainer feed's reading, batching and committing.


class FeedError(SinkError):
    """The trainer feed cannot go on (Kafka unreachable, a commit refused)."""


class BudgetError(SinkError, ValueError):
    """A budget or row length that cannot hold anything."""


# Trainer errors: the online trainer's model, checkpoints and weight pushes.


class TrainerError(SinkError):
    """The trainer cannot go on (no torch, no model, the proxy refused the weights)."""


class PolicyApiError(TrainerError):
    """The proxy's policy API refused a call or did not answer; the message has its status and answer."""


__all__ = ["BudgetError", "FeedError", "PolicyApiError", "SinkError", "TrainerError"]
