"""Exceptions raised by the embedded engine's launcher; each message says what to change."""

from deploy.errors import DeployError


class EngineStartError(DeployError):
    """The model engine could not be installed, built, or started, or did not become ready in time."""


class EngineInstallError(EngineStartError):
    """pip could not create the vLLM CPU environment."""


class ModelBuildError(EngineStartError):
    """The tiny model (tokenizer, config, weights) could not be built."""
