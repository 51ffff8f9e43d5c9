"""The gateway node's settings, read from the environment (``ROLLWIRE_GATEWAY_*``).

Kafka itself (bootstrap, topic prefix, partition counts) comes from
:class:`schemas.transport.KafkaSettings` (``ROLLWIRE_*``); these are the node's own knobs.
"""

from __future__ import annotations

import os
import socket

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_node_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class GatewaySettings(BaseSettings):
    """How a gateway node takes sessions and runs them. Every field reads ``ROLLWIRE_GATEWAY_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_GATEWAY_", extra="ignore")

    proxy_url: str = Field(default="http://127.0.0.1:18080", description=(
        "The proxy as this machine reaches it; a runtime rewrites it for the harness (the docker runtime's "
        "socket relay)."))
    init_workers: int = Field(default=4, ge=1, description="Runtime inits at once.")
    run_slots: int = Field(default=4, ge=1, description="Harness runs at once.")
    post_workers: int = Field(default=2, ge=1, description="Post-runs (the patch) and teardowns at once.")
    prewarm: int = Field(default=2, ge=0, description=(
        "Runtimes initialized ahead of free run slots: a session holds one of run_slots + prewarm places "
        "from the start of its init to the end of its run; 0 puts every init on the critical path."))
    group_id: str = Field(default="gateway", min_length=1, description=(
        "The consumer group on `sessions`, behind the topic prefix so that two deployments on one cluster "
        "never share a group."))
    node_name: str = Field(default_factory=_default_node_name, min_length=1, max_length=128, description=(
        "This node in stage events and in the group (its client id); unique. Default: <host>-<pid>."))
    host: str = Field(default="127.0.0.1", description="Listen address of the node's HTTP endpoint.")
    port: int = Field(default=18083, ge=0, le=65535, description=(
        "Port of the node's HTTP endpoint (health, sessions held, cancel); 0 turns it off."))
    post_timeout_s: float = Field(default=120.0, gt=0, description=(
        "The patch's own budget, outside the session's, so that a timed-out session still ends with its patch."))
    teardown_timeout_s: float = Field(default=120.0, gt=0, description="Longest wait for a runtime's teardown.")
    max_patch_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, description=(
        "A larger patch is a policy failure (it would not fit an event)."))
    recheck_s: float = Field(default=2.0, gt=0, description=(
        "How often a session that another live node holds is looked at again."))
    engine_url: str | None = Field(default=None, description=(
        "The engine behind the proxy, as this machine reaches it. When set, its /health is asked before each "
        "harness run and after a run that failed without a model call, so that an engine that is down is "
        "named as the cause (an infrastructure failure) instead of the harness's exit being left unknown."))
    log_level: str = Field(default="info", description="Log level of the node.")

    @model_validator(mode="after")
    def _proxy_url_is_http(self) -> GatewaySettings:
        if not self.proxy_url.startswith(("http://", "https://")):
            raise ValueError(f"ROLLWIRE_GATEWAY_PROXY_URL {self.proxy_url!r} must be an http(s) URL")
        self.proxy_url = self.proxy_url.rstrip("/")
        if self.engine_url is not None:
            self.engine_url = self.engine_url.rstrip("/") or None
        return self

    def group(self, topic_prefix: str) -> str:
        """The consumer group name on a deployment's topics."""
        return f"{topic_prefix}{self.group_id}"
