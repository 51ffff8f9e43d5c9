"""Where one model call's time goes: the proxy's four stages, timed per call (bench.proxy_overhead prints them).

- ``parse``: from the request's arrival to the engine request going out (authentication, reading and
  parsing the body, normalizing it, the policy gate, building the engine body): the proxy's own work.
- ``upstream_wait``: from the engine request to the engine's first bytes (a whole reply: to the whole
  reply; an exact continuation: render, generate and derender through the token API), and then to the
  call's number, when its claim is slower than the engine (proxy/routes/calls.py).
- ``relay``: a stream, from the engine's first bytes to its last chunk written to the client (the
  engine's own pace included); a whole reply or a synthesized stream, rendering the reply once recorded.
- ``capture``: building and encoding the completion event and waiting for Kafka's ack (the durable
  capture every reply's end waits for).

Only served calls are timed; a failed call has no ``relay`` and its event is a best-effort write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STAGES = ("parse", "upstream_wait", "relay", "capture")


@dataclass(slots=True)
class StageTimes:
    """Seconds spent in each stage of one call; a stage not (yet) reached is None."""

    started: float = field(default_factory=time.perf_counter)
    parse: float | None = None
    upstream_wait: float | None = None
    relay: float | None = None
    capture: float | None = None
    _mark: float = 0.0

    def upstream_starts(self) -> None:
        """The engine request goes out now: ``parse`` ends."""
        self._mark = time.perf_counter()
        self.parse = self._mark - self.started

    def first_bytes(self) -> None:
        """The engine's first bytes (or whole reply) are in: ``upstream_wait`` ends."""
        if self.upstream_wait is None and self._mark:
            now = time.perf_counter()
            self.upstream_wait, self._mark = now - self._mark, now

    def relayed(self) -> None:
        """The engine's last chunk is out to the client: ``relay`` ends."""
        if self._mark:
            self.relay = time.perf_counter() - self._mark

    def done(self) -> dict[str, float] | None:
        """Each stage's seconds, once all four were timed; None otherwise."""
        values = (self.parse, self.upstream_wait, self.relay, self.capture)
        if any(value is None for value in values):
            return None
        return {stage: value for stage, value in zip(STAGES, values, strict=True) if value is not None}
