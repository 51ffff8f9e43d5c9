"""Which engine a call goes to: pure functions over the pool's loads.

``sticky_least_loaded`` (the default): a branch's first call goes to the healthy engine with the fewest
calls in flight; its later calls go to the same engine while it is healthy and under its cap, so that the
branch's growing prompt stays in that engine's prefix cache. Pure hashing pins sessions to an engine
whatever its load, and round-robin spreads every call, which loses the cache; both are kept for comparison
(``bench.engines`` measures the three side by side).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Placement = Literal["sticky_least_loaded", "round_robin", "consistent_hash"]


@dataclass(frozen=True)
class Load:
    """What placement knows of one engine."""

    id: str
    healthy: bool
    in_flight: int


def least_loaded(loads: Sequence[Load], turn: int) -> str | None:
    """The healthy engine with the fewest calls in flight; ties go round by ``turn`` (never all to the first)."""
    healthy = [load for load in loads if load.healthy]
    if not healthy:
        return None
    fewest = min(load.in_flight for load in healthy)
    tied = [load.id for load in healthy if load.in_flight == fewest]
    return tied[turn % len(tied)]


def rendezvous(loads: Sequence[Load], key: str) -> str | None:
    """Plain consistent hashing (highest random weight) of ``key`` over the healthy engines."""
    healthy = [load.id for load in loads if load.healthy]
    if not healthy:
        return None
    return max(healthy, key=lambda engine: hashlib.blake2b(f"{engine}\0{key}".encode(), digest_size=8).digest())


def choose(policy: Placement, loads: Sequence[Load], *, pinned: str | None, session_id: str, cap: int,
           turn: int) -> str | None:
    """The engine for a call under ``policy``; None when no engine is healthy."""
    if policy == "round_robin":
        healthy = [load.id for load in loads if load.healthy]
        return healthy[turn % len(healthy)] if healthy else None
    if policy == "consistent_hash":
        return rendezvous(loads, session_id)
    by_id = {load.id: load for load in loads}
    pin = by_id.get(pinned) if pinned is not None else None
    if pin is not None and pin.healthy and (pin.in_flight < cap or not _room_elsewhere(loads, pin.id, cap)):
        return pin.id
    return least_loaded(loads, turn)


def _room_elsewhere(loads: Sequence[Load], pinned: str, cap: int) -> bool:
    return any(load.healthy and load.in_flight < cap for load in loads if load.id != pinned)


def pin_is_full(loads: Sequence[Load], pinned: str | None, cap: int) -> bool:
    """The pinned engine is healthy but at its cap, and another healthy engine has room: worth a brief wait
    before the branch moves. With nowhere else to go (one engine, or every other one full or down) the call
    stays on its pin at once: a wait could only end where it started, its prefix cache still there."""
    pin = next((load for load in loads if load.id == pinned), None)
    if pin is None or not pin.healthy or pin.in_flight < cap:
        return False
    return _room_elsewhere(loads, pin.id, cap)
