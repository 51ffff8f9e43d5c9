"""Proxy settings, read from the environment (``ROLLWIRE_*``) with the embedded defaults."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

CaptureCompression = Literal["auto", "broker", "producer"]


class ProxySettings(BaseSettings):
    """How the proxy listens, which engine it calls, and its limits. Every field reads ``ROLLWIRE_<FIELD>``.

    ``ROLLWIRE_ENGINE_URL`` (default ``http://127.0.0.1:18000``, the embedded vLLM CPU server) names the
    upstream vLLM OpenAI server; ``ROLLWIRE_SERVED_MODEL`` pins the model name sent upstream (default:
    the first model the engine lists).
    """

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_", extra="ignore")

    engine_url: str = "http://127.0.0.1:18000"
    served_model: str | None = None
    proxy_host: str = "127.0.0.1"
    proxy_port: int = 18080
    proxy_public_url: str | None = Field(default=None, description="Base URL harnesses use, if not host:port.")
    proxy_max_body_bytes: int | None = Field(default=None, ge=1024, description=(
        "Largest request body; default half the Kafka record limit (ROLLWIRE_MAX_MESSAGE_BYTES), since a "
        "call's event holds its messages and its prompt token ids. Larger bodies get a 413."))
    engine_connect_timeout_s: float = Field(default=5.0, gt=0)
    engine_timeout_s: float = Field(default=600.0, gt=0, description="Longest wait for the engine's reply.")
    capture_timeout_s: float = Field(default=15.0, gt=0, description="Longest wait for Kafka to ack an event.")
    proxy_shutdown_grace_s: int = Field(default=30, ge=0, description=(
        "On SIGTERM/SIGINT, how long calls in flight may still finish before they are cut (a call waiting "
        "on a stuck engine would otherwise hold the proxy up to engine_timeout_s)."))
    capture_producers: int = Field(default=4, ge=1, le=16, description=(
        "Kafka producers sharing the proxy's writes, each with its own request in flight (a session's "
        "events always through the same one, so they keep their order). aiokafka keeps one request in flight "
        "per broker and producer, so with one producer 16 streams ending together wait for each other's "
        "acks: 4 halved the capture stage at 16 streams in bench.proxy_overhead (issue 17)."))
    capture_compression: CaptureCompression = Field(default="auto", description=(
        "Who compresses the proxy's events. `broker`: they are sent as they are and the topic compresses "
        "them (the registry creates the completions and sessions topics with compression.type=zstd), so a "
        "reply's end does not wait for zstd on the proxy's event loop (0.6 ms per 140 kB event, one after "
        "another when streams end together: side by side in bench.proxy_overhead at 16 streams, a median "
        "0.84 of the added p50 of compressing in the proxy; issue 17). `producer`: zstd in the proxy. "
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
        "When set, the policy API (GET /v1/policy, POST /v1/policy/weights) needs "
        "`Authorization: Bearer <token>`; unset, it is open (a development proxy)."))
    policy_floor_wait_s: float = Field(default=600.0, ge=0, description=(
        "How long a call of a session whose policy_version is a number waits for the engine to serve that "
        "version (or a newer one) before it fails with a 503."))
    weight_update_timeout_s: float = Field(default=1800.0, gt=0, description=(
        "Longest wait for one engine step of a weight update (pausing, loading the weights)."))

    def max_body_bytes(self, max_message_bytes: int) -> int:
        """The body limit in force: the configured one, or half of what one Kafka record may hold."""
        return self.proxy_max_body_bytes or max_message_bytes // 2

    @property
    def public_url(self) -> str:
        return self.proxy_public_url or f"http://{self.proxy_host}:{self.proxy_port}"
