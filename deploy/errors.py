"""Exceptions raised by the deploy tooling; each message says what to change."""


class DeployError(Exception):
    """Base class for failures starting, stopping or resolving local services."""


class MissingToolError(DeployError):
    """A program the launcher needs (java, mvn) is not on PATH."""


class ResolveError(DeployError):
    """Maven could not resolve the Kafka broker jars."""


class BrokerStartError(DeployError):
    """The broker process died or did not answer in time."""


class EngineStartError(DeployError):
    """The model engine (vLLM) could not be installed or did not become ready."""
