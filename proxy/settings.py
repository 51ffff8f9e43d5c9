"""Proxy settings, read from the environment (``ROLLWIRE_*``) with the embedded defaults."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

CaptureCompression = Literal["auto", "broker", "producer"]


class ProxySettings(BaseSettings):
    """How the proxy listens, which engine it calls, and its limits. Every field reads ``ROLLWIRE_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_", extra="ignore")

    engine_url: str = Field(default="http://127.0.0.1:18000", description=(
        "The upstream vLLM OpenAI server (started with `--enable-scale-out` for exact-token continuation); "
        "default: the embedded vLLM CPU engine."))
    engine_urls: str | None = Field(default=None, description=(
        "A pool of engines, comma-separated, each `URL` or `NAME=URL` (the name, else the URL, is the engine's "
        "id on every completion event); takes precedence over ROLLWIRE_ENGINE_URL."))
    engine_pool_file: str | None = Field(default=None, description=(
        "A file naming the pool, one `URL` or `NAME=URL` a line (# comments): re-read when it changes, so "
        "engines join and leave while the proxy runs. Takes precedence over ROLLWIRE_ENGINE_URLS."))
    engine_placement: Literal["sticky_least_loaded", "round_robin", "consistent_hash"] = Field(
        default="sticky_least_loaded", description=(
            "How calls are placed on the pool: `sticky_least_loaded` (a branch's first call on the healthy "
            "engine with the fewest calls in flight, its later calls on the same engine while it is healthy "
            "and under its cap), `round_robin` or `consistent_hash` (of the session id), for comparison."))
    engine_max_in_flight: int = Field(default=16, ge=1, description=(
        "Calls in flight per engine above which a pinned branch waits briefly (engine_pin_wait_s) and is then "
        "moved to the least-loaded engine, when another engine has room (else it stays where it is)."))
    engine_pin_wait_s: float = Field(default=1.0, ge=0, description=(
        "How long a call whose pinned engine is at its cap waits for room there before it moves (a move "
        "costs the branch its prefix cache)."))
    engine_health_interval_s: float = Field(default=2.0, gt=0, description=(
        "How often every engine's /health (and its prefix-cache counters) is read; an engine that fails "
        "it, or refuses a connection, gets no new calls until it answers again."))
    served_model: str | None = Field(default=None, description=(
        "The model name sent upstream; default: the first model the engine lists."))
    proxy_host: str = Field(default="127.0.0.1", description="Where the proxy listens.")
    proxy_port: int = Field(default=18080, description="The proxy's port.")
    proxy_public_url: str | None = Field(default=None, description="Base URL harnesses use, if not host:port.")
    proxy_max_body_bytes: int | None = Field(default=None, ge=1024, description=(
        "Largest request body; default half the Kafka record limit (ROLLWIRE_MAX_MESSAGE_BYTES), since a "
        "call's event holds its messages and its prompt token ids. Larger bodies get a 413."))
    engine_connect_timeout_s: float = Field(default=5.0, gt=0, description=(
        "Longest wait to open a connection to the engine."))
    engine_timeout_s: float = Field(default=600.0, gt=0, description="Longest wait for the engine's reply.")
    capture_timeout_s: float = Field(default=15.0, gt=0, description="Longest wait for Kafka to ack an event.")
    proxy_shutdown_grace_s: int = Field(default=30, ge=0, description=(
        "On SIGTERM/SIGINT, how long calls in flight may still finish before they are cut (a call waiting "
        "on a stuck engine would otherwise hold the proxy up to engine_timeout_s)."))
    capture_producers: int = Field(default=4, ge=1, le=16, description=(
        "Kafka producers sharing the proxy's writes, each with its own request in flight (a session's "
        "events always through the same one, so they keep their order). aiokafka keeps one request in flight "
        "per broker and producer, so with one producer streams ending together wait for each other's acks "
        "(bench.proxy_overhead measures it)."))
    capture_compression: CaptureCompression = Field(default="auto", description=(
        "Who compresses the proxy's events. `broker`: they are sent as they are and the topic compresses "
        "them (the registry creates the completions and sessions topics with compression.type=zstd), so a "
        "reply's end does not wait for zstd on the proxy's event loop, one event after another when streams "
        "end together (bench.proxy_overhead measures it). `producer`: zstd in the proxy. "
        "`auto`: `broker` when the completions topic's compression.type compresses (or is "
        "`uncompressed`), `producer` when it is `producer` (a topic created before rollwire set zstd) or "
        "cannot be read."))
    session_wait_s: float = Field(default=3.0, ge=0, description=(
        "How long an unknown session id or key waits for the registry to catch up before a 401."))
    upstream_stream: bool = Field(default=True, description=(
        "Relay the engine's stream; when false, call the engine whole and synthesize the stream."))
    record_request_body: bool = Field(default=False, description=(
        "Keep the original request body in completion events besides its sha256 digest (larger events)."))

    proxy_admin_token: str | None = Field(default=None, description=(
        "When set, the admin API needs `Authorization: Bearer <token>`: the policy API (GET /v1/policy, "
        "POST /v1/policy/weights), creating sessions (POST /v1/sessions), and reading or ending any session. "
        "`rollwire up` makes one into $ROLLWIRE_HOME/proxy-admin-token unless it is set; unset on a proxy "
        "started alone, that API is open (a development proxy)."))
    policy_floor_wait_s: float = Field(default=600.0, ge=0, description=(
        "How long a call of a session whose policy_version is a number waits for the engine to serve that "
        "version (or a newer one) before it fails with a 503."))
    weight_update_timeout_s: float = Field(default=1800.0, gt=0, description=(
        "Longest wait for one engine step of a weight update (pausing, loading the weights)."))

    proxy_instance: str | None = Field(default=None, description=(
        "This proxy process's name within its tier (on the events it writes for the tier: call claims, weight "
        "update acknowledgements); default: host, port and process id."))
    proxy_tier_heartbeat_s: float = Field(default=5.0, gt=0, description=(
        "How often this proxy process says on the `policy` topic that it is live, so that a weight update "
        "waits for its drain (a small record each time; the topic keeps them)."))
    proxy_tier_timeout_s: float = Field(default=15.0, gt=0, description=(
        "A proxy process not heard from for this long is taken for gone: a weight update does not wait for "
        "it, and a process whose update's coordinator went silent this long reopens its gate. Longer than "
        "proxy_tier_heartbeat_s."))

    restore_timeout_s: float = Field(default=10.0, gt=0, description=(
        "Longest read of a session's log before one of its calls, when another proxy process served some of "
        "its calls (or this one before it was started again); past it the call is rendered whole and its "
        "event says `restore_timed_out`."))

    def max_body_bytes(self, max_message_bytes: int) -> int:
        """The body limit in force: the configured one, or half of what one Kafka record may hold."""
        return self.proxy_max_body_bytes or max_message_bytes // 2

    @property
    def instance(self) -> str:
        """This process's name within the proxy tier."""
        return self.proxy_instance or f"{socket.gethostname()}:{self.proxy_port}:{os.getpid()}"

    @property
    def public_url(self) -> str:
        return self.proxy_public_url or f"http://{self.proxy_host}:{self.proxy_port}"
