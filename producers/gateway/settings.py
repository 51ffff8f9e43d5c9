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
    """Every field reads ``ROLLWIRE_GATEWAY_<FIELD>``.

    ``PROXY_URL`` (``http://127.0.0.1:18080``): the proxy as this machine reaches it; a runtime rewrites it
    for the harness (``RuntimeHandle.proxy_url_for``: the docker runtime's socket relay).
    ``INIT_WORKERS`` (4): runtime inits at once. ``RUN_SLOTS`` (4): harness runs at once.
    ``POST_WORKERS`` (2): post-runs (patch) and teardowns at once.
    ``PREWARM`` (2): runtimes initialized ahead of free run slots; a session holds one of
    ``RUN_SLOTS + PREWARM`` places from the start of its init to the end of its run, so with 0 a runtime
    is initialized only when a run slot is free for it (init on the critical path).
    ``GROUP_ID`` (``gateway``): the consumer group on ``sessions``; the topic prefix is put in front so
    that two deployments on one cluster never share a group.
    ``NODE_NAME`` (``<host>-<pid>``): this node in stage events and in the group (its client id); unique.
    ``HOST``/``PORT`` (127.0.0.1:18083): the node's HTTP endpoint (health, sessions held, cancel);
    port 0 turns it off.
    ``POST_TIMEOUT_S`` (120): the patch's own budget, outside the session's, so a timed-out session still
    ends with its patch. ``TEARDOWN_TIMEOUT_S`` (120).
    ``MAX_PATCH_BYTES`` (4 MiB): a larger patch is a policy failure (it would not fit an event).
    ``RECHECK_S`` (2): how often a session another live node holds is looked at again.
    ``LOG_LEVEL`` (``info``).
    """

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_GATEWAY_", extra="ignore")

    proxy_url: str = "http://127.0.0.1:18080"
    init_workers: int = Field(default=4, ge=1)
    run_slots: int = Field(default=4, ge=1)
    post_workers: int = Field(default=2, ge=1)
    prewarm: int = Field(default=2, ge=0)
    group_id: str = Field(default="gateway", min_length=1)
    node_name: str = Field(default_factory=_default_node_name, min_length=1, max_length=128)
    host: str = "127.0.0.1"
    port: int = Field(default=18083, ge=0, le=65535)
    post_timeout_s: float = Field(default=120.0, gt=0)
    teardown_timeout_s: float = Field(default=120.0, gt=0)
    max_patch_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    recheck_s: float = Field(default=2.0, gt=0)
    log_level: str = "info"

    @model_validator(mode="after")
    def _proxy_url_is_http(self) -> GatewaySettings:
        if not self.proxy_url.startswith(("http://", "https://")):
            raise ValueError(f"ROLLWIRE_GATEWAY_PROXY_URL {self.proxy_url!r} must be an http(s) URL")
        self.proxy_url = self.proxy_url.rstrip("/")
        return self

    def group(self, topic_prefix: str) -> str:
        """The consumer group name on a deployment's topics."""
        return f"{topic_prefix}{self.group_id}"
