"""Exceptions raised by the deploy tooling (local Kafka, its jars); each message says what to change.

The embedded model engine's errors live in ``deploy.engine.errors`` and derive from :class:`DeployError` too,
so that ``rollwire up/down/status`` can report any of them the same way. Topic set-up is not deploy's: it
raises :class:`schemas.transport.errors.TopicSetupError` (a TransportError), re-exported here under its name.
"""

from schemas.transport.errors import TopicSetupError

__all__ = ["BrokerStartError", "BrokerStopError", "ConfigError", "DeployError", "MissingToolError",
           "ResolveError", "TopicSetupError"]


class DeployError(Exception):
    """Base class for failures configuring, resolving, starting or stopping local services."""


class ConfigError(DeployError, ValueError):
    """A setting (argument or ``ROLLWIRE_*`` variable) has a value the launcher cannot use."""


class MissingToolError(DeployError):
    """A program the launcher needs (Java 17+, Maven) is not on PATH."""


class ResolveError(DeployError):
    """Maven could not resolve the Kafka broker's jars."""


class BrokerStartError(DeployError):
    """The broker could not be formatted or started, died while starting, or did not answer in time."""


class BrokerStopError(DeployError):
    """The broker's process could not be signalled or outlived SIGKILL."""
