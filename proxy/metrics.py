"""Prometheus metrics for the proxy: requests, errors, latency and where it went (stages: parse, upstream
wait, relay, capture), completion events by status, how prompts
were built (exact continuations, new branches and why, drift a full re-render would have had), and the
policy: weight updates by status, how long calls were held, the calls held now, the version serving."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proxy.stages import StageTimes
from schemas.completions import Continuation

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Stages run from a fraction of a millisecond (parse, capture) to a long reply's whole relay.
_STAGE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class ProxyMetrics:
    """One registry per app, so that several apps (tests) do not share counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("rollwire_proxy_requests", "Model calls received.", ["api", "status"],
                                registry=self.registry)
        self.errors = Counter("rollwire_proxy_errors", "Model calls that failed, by kind.", ["api", "kind"],
                              registry=self.registry)
        self.latency = Histogram("rollwire_proxy_request_seconds", "Time to serve a model call.", ["api"],
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.stage_seconds = Histogram(
            "rollwire_proxy_stage_seconds", "Where a served call's time went, observed once per stage and call "
            "(proxy/stages.py): parse, upstream_wait, relay, capture (the wait for Kafka's ack).",
            ["api", "stage"], buckets=_STAGE_BUCKETS, registry=self.registry)
        self.capture_outages = Histogram(
            "rollwire_proxy_capture_outage_seconds", "How long captures failed before one succeeded again "
            "(Kafka down, or a partition without a leader while it moved): harnesses got retryable errors "
            "meanwhile.", buckets=_PAUSE_BUCKETS, registry=self.registry)
        self.capture_failing = Gauge("rollwire_proxy_capture_failing", "1 while captures fail (an outage "
                                     "not over yet), else 0.", registry=self.registry)
        self.capture_compression = Gauge(
            "rollwire_proxy_capture_compression", "1 for who compresses captured events (by: producer, broker, "
            "or auto while not settled yet: ROLLWIRE_CAPTURE_COMPRESSION).", ["by"], registry=self.registry)
        self.events = Counter("rollwire_proxy_completion_events", "Completion events recorded, by status.",
                              ["status"], registry=self.registry)
        self.continuations = Counter(
            "rollwire_proxy_continuations", "Recorded calls by how the prompt was built: mode exact or rendered, "
            "and for new branches why (opened).", ["api", "mode", "opened"], registry=self.registry)
        self.drift = Counter(
            "rollwire_proxy_drift", "Exactly continued calls by what a full re-render would have changed "
            "(kind none: nothing).", ["api", "kind"], registry=self.registry)
        self.sessions = Gauge("rollwire_proxy_sessions", "Sessions the registry knows, by state.", ["state"],
                              registry=self.registry)
        self.weight_updates = Counter("rollwire_proxy_weight_updates", "Weight updates coordinated, by status.",
                                      ["status"], registry=self.registry)
        self.pause_seconds = Histogram(
            "rollwire_proxy_weight_update_pause_seconds", "How long new model calls were held by a weight update.",
            buckets=_PAUSE_BUCKETS, registry=self.registry)
        self.calls_held = Gauge("rollwire_proxy_calls_waiting", "Model calls held now: for a weight update to "
                                "finish, or for the engine to reach their session's policy version.",
                                registry=self.registry)
        self.calls_held_total = Counter("rollwire_proxy_calls_held", "Model calls that were held "
                                        "(weight update or policy floor).", registry=self.registry)
        self.policy_version = Gauge("rollwire_proxy_policy_version", "The engine's weight version, when it is a "
                                    "number (-1: unknown).", registry=self.registry)
        self.policy_version.set(-1)
        self.engine_healthy = Gauge("rollwire_proxy_engine_healthy", "1 while the engine gets new calls.",
                                    ["engine"], registry=self.registry)
        self.engine_in_flight = Gauge("rollwire_proxy_engine_in_flight", "Calls on the engine now.", ["engine"],
                                      registry=self.registry)
        self.engine_calls = Gauge("rollwire_proxy_engine_calls_total", "Calls placed on the engine.", ["engine"],
                                  registry=self.registry)
        self.engine_errors = Gauge("rollwire_proxy_engine_errors_total", "Calls that failed on the engine.",
                                   ["engine"], registry=self.registry)
        self.engine_hit_rate = Gauge("rollwire_proxy_engine_prefix_cache_hit_rate", "The engine's own prefix-cache "
                                     "hit rate since it started (-1: it does not say).", ["engine"],
                                     registry=self.registry)
        self.restores = Histogram(
            "rollwire_proxy_restore_seconds", "Reads of a session's log before one of its calls, because another "
            "process served some of its calls (or this one before it was started again), by outcome.",
            ["outcome"], buckets=_STAGE_BUCKETS, registry=self.registry)
        self.restore_bytes = Counter("rollwire_proxy_restore_bytes", "Bytes of completions read to restore "
                                     "sessions' branches.", registry=self.registry)
        self.call_numbers = Histogram(
            "rollwire_proxy_call_number_seconds", "Numbering a call on the claims log: its claim written, then "
            "waited for until this process's reader has passed it.", buckets=_STAGE_BUCKETS, registry=self.registry)
        self.call_number_waits = Histogram(
            "rollwire_proxy_call_number_wait_seconds", "How long a call, placed and sent to the engine while its "
            "claim was on its way, then waited for its number before its first byte to the harness.",
            buckets=_STAGE_BUCKETS, registry=self.registry)
        self.calls_placed_again = Counter(
            "rollwire_proxy_calls_placed_again", "Calls placed before their number was in whose session's log, "
            "read once the number came, held calls of another process that changed the branches: the engine "
            "request was dropped and the call placed again.", registry=self.registry)
        self._engines: Callable[[], list[dict[str, Any]]] | None = None

    def error(self, api: str, kind: str) -> None:
        self.errors.labels(api=api, kind=kind).inc()

    def stages(self, api: str, times: StageTimes) -> None:
        """Observe a served call's four stages (nothing if one of them was not timed)."""
        done = times.done()
        if done is None:
            return
        for stage, seconds in done.items():
            self.stage_seconds.labels(api=api, stage=stage).observe(seconds)

    def restored(self, seconds: float, bytes_read: int, failed: str | None) -> None:
        """One read of a session's log (``failed``: why its branches may still be behind it)."""
        self.restores.labels(outcome=failed or "ok").observe(seconds)
        self.restore_bytes.inc(bytes_read)

    def event(self, status: str) -> None:
        self.events.labels(status=status).inc()

    def continuation(self, api: str, continuation: Continuation | None) -> None:
        if continuation is None:
            return
        self.continuations.labels(api=api, mode=continuation.mode, opened=continuation.opened or "").inc()
        drift = continuation.drift
        if drift is not None:
            kinds: Sequence[str] = drift.kinds
            if not kinds and not drift.differs:
                kinds = ["none"]
            for kind in kinds:
                self.drift.labels(api=api, kind=kind).inc()

    def watch_engines(self, states: Callable[[], list[dict[str, Any]]]) -> None:
        """Where the per-engine figures come from when the page is rendered (the pool's own state)."""
        self._engines = states

    def render(self, session_counts: dict[str, int]) -> bytes:
        for state, count in session_counts.items():
            self.sessions.labels(state=state).set(count)
        for engine in self._engines() if self._engines is not None else ():
            name = str(engine["id"])
            self.engine_healthy.labels(engine=name).set(float(bool(engine["healthy"])))
            self.engine_in_flight.labels(engine=name).set(float(engine["in_flight"]))
            self.engine_calls.labels(engine=name).set(float(engine["calls"]))
            self.engine_errors.labels(engine=name).set(float(engine["errors"]))
            rate = engine["prefix_cache_hit_rate"]
            self.engine_hit_rate.labels(engine=name).set(-1.0 if rate is None else float(rate))
        return generate_latest(self.registry)
