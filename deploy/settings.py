"""Settings of the processes ``deploy/`` launches itself: the project's Kafka broker, the embedded engine and
the proxy tier.

Each class reads its ``ROLLWIRE_*`` variables once, when a launcher asks for its configuration; a value that
cannot be used fails there with a :class:`ConfigError` that names the variable, never later in the process
it would have configured.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from deploy.errors import ConfigError

DEFAULT_KAFKA_VERSION = "4.3.1"
DEFAULT_KAFKA_PORT = 19092
DEFAULT_KAFKA_HEAP = "-Xms256m -Xmx768m"
DEFAULT_ENGINE_PORT = 18000
DEFAULT_PROXY_TIER_PORT = 18100
DEFAULT_PROXY_STATS_PORT = 18099
MAX_PROXY_COUNT = 32

_Settings = TypeVar("_Settings", bound=BaseSettings)


class KafkaLauncherSettings(BaseSettings):
    """The project's own Kafka on this machine (``rollwire up``, the tests' broker)."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_KAFKA_", extra="ignore", env_ignore_empty=True)

    version: str = Field(default=DEFAULT_KAFKA_VERSION, description=(
        "Apache Kafka release whose broker jars are resolved through Maven (a 4.x release)."))
    port: int = Field(default=DEFAULT_KAFKA_PORT, description=(
        "Port of the local broker; its controller listens on the next one, a cluster's node i on port + 2(i-1)."))
    heap: str = Field(default=DEFAULT_KAFKA_HEAP, description="JVM heap options of each local broker.")
    brokers: int = Field(default=1, ge=1, le=9, description=(
        "Nodes of the project's own Kafka on this machine (`rollwire up --brokers 3`: a three-node KRaft cluster)."))


class EngineServerSettings(BaseSettings):
    """The embedded vLLM CPU engine (``rollwire up`` starts it unless ``ROLLWIRE_ENGINE_URL`` names one)."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_ENGINE_", extra="ignore", env_ignore_empty=True)

    port: int = Field(default=DEFAULT_ENGINE_PORT, description=(
        "Port of the embedded engine's OpenAI server; with several engines, the first one's (the others "
        "take the ports after it)."))
    count: int = Field(default=1, ge=1, le=64, description=(
        "Embedded engines `rollwire up` and the main job start (`--engines`), each with its own home, all "
        "named to the proxy as one pool (ROLLWIRE_ENGINE_URLS)."))
    seed: int = Field(default=0, description=(
        "Seed of the tiny model's random weights and of the server's default sampling seed."))
    max_model_len: int = Field(default=4096, description=(
        "Longest sequence the embedded engine takes (the main job raises it to hold a harness's prompt)."))
    logprobs_mode: str = Field(default="processed_logprobs", description=(
        "Which logprobs vLLM returns: `processed_logprobs` (the distribution each token was sampled from), "
        "`raw_logprobs`, `raw_logits` or `processed_logits`."))
    args: str = Field(default="", description="More vLLM server flags for the embedded engine, shell-quoted.")


class ProxyTierSettings(BaseSettings):
    """The proxy tier ``rollwire up`` and the main job run: one proxy process, or several behind HAProxy on the
    proxy's own address (deploy/proxy_front.py). The proxy's own settings (``ROLLWIRE_PROXY_HOST``,
    ``ROLLWIRE_PROXY_PORT``, the engine pool, Kafka) are every process's."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_PROXY_", extra="ignore", env_ignore_empty=True)

    count: int = Field(default=1, ge=1, le=MAX_PROXY_COUNT, description=(
        "Proxy processes `rollwire up` and the main job run (`--proxies`). With more than one, each listens on "
        "a port of its own (ROLLWIRE_PROXY_TIER_PORT and the ports after it) and is named `proxy-<i>` "
        "(ROLLWIRE_PROXY_INSTANCE); HAProxy listens on ROLLWIRE_PROXY_HOST:ROLLWIRE_PROXY_PORT in front of them "
        "and sends a session's calls to one process (the least busy one for its first call, then the same one, by its path's session id, else its "
        "key). With one, the proxy itself listens there and no HAProxy runs."))
    tier_port: int = Field(default=DEFAULT_PROXY_TIER_PORT, ge=1, le=65535, description=(
        "Port of the first proxy process behind HAProxy (`proxy-0`); `proxy-<i>` listens on this + i (a port "
        "something else holds is replaced by a free one)."))
    stats_port: int = Field(default=DEFAULT_PROXY_STATS_PORT, ge=1, le=65535, description=(
        "Port of HAProxy's own page on ROLLWIRE_PROXY_HOST: `/stats` (each proxy process's state, `;csv` for "
        "a machine) and `/health` (200 while at least one proxy process is up)."))
    backends: str | None = Field(default=None, description=(
        "The proxy processes HAProxy balances over, comma-separated `NAME=URL` entries; `rollwire up` and the "
        "main job set it for the HAProxy they start. Default: ROLLWIRE_PROXY_COUNT processes from "
        "ROLLWIRE_PROXY_TIER_PORT on ROLLWIRE_PROXY_HOST."))


def load(settings: type[_Settings]) -> _Settings:
    """``settings`` read from the environment, or a :class:`ConfigError` naming the variable to change."""
    try:
        return settings()
    except ValidationError as exc:
        prefix = str(settings.model_config.get("env_prefix", ""))
        problems = "; ".join(
            f"{prefix}{'_'.join(str(part) for part in error['loc']).upper()}={error.get('input')!r}: {error['msg']}"
            for error in exc.errors())
        raise ConfigError(f"{problems}; fix the variable or unset it") from exc
