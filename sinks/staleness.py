"""How stale a rollout may be for the trainer feed: the policy lag of a group or trajectory, and its fate.

The *lag* of something the feed reads is the trainer's current policy version minus the **oldest** engine
weight version among its tokens (``policy_versions.oldest`` of a group or trajectory; see schemas.policy).
With ``max_staleness`` set, what lags more than that many versions behind is either

- ``"drop"``: passed over (the feed still acknowledges past it, so it is not delivered again), or
- ``"downweight"``: kept, its advantages multiplied by ``decay ** (lag - max_staleness)``: one version
  too old halves them with the default ``decay`` 0.5, two quarter them, and so on.

Something without versions (events recorded before the proxy filled them, or an engine that reports
none) is treated as current: lag unknown, weight 1. So is everything while the trainer has not said which
version it is at (no ``policy_version``): nothing is stale before the first push. A negative lag (rollouts
newer than the version the trainer reported) is within bounds.

Pure values, no Kafka: the feed (sinks/feed.py) asks :meth:`StalenessPolicy.judge` when it lays a group or
trajectory into a batch, so the lag is measured against the trainer's version at that moment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

StaleAction: TypeAlias = Literal["drop", "downweight"]
VersionSource: TypeAlias = int | Callable[[], int] | None  # the trainer's version, or how to ask for it


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the feed does with one group or trajectory: its lag (None: unknown), whether it lags more than
    allowed, the factor applied to its advantages, and whether it is dropped instead."""

    lag: int | None
    stale: bool = False
    weight: float = 1.0
    drop: bool = False


CURRENT = Verdict(lag=None)


def current_version(source: VersionSource) -> int | None:
    """The trainer's version now: the number, or what the callable returns (None: not known)."""
    if source is None:
        return None
    value = source() if callable(source) else source
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"the trainer's policy version must be an int, got {value!r}")
    return value


def lag_of(oldest: int | None, current: int | None) -> int | None:
    """How many versions ``oldest`` is behind ``current`` (None when either is unknown)."""
    if oldest is None or current is None:
        return None
    return current - oldest


class StalenessPolicy:
    """``max_staleness`` (None: no limit), what to do past it, and the downweighting ``decay``."""

    def __init__(self, max_staleness: int | None = None, action: StaleAction = "drop", decay: float = 0.5) -> None:
        if max_staleness is not None and (isinstance(max_staleness, bool) or max_staleness < 0):
            raise ValueError(f"max_staleness must be a number of versions >= 0 (or None), got {max_staleness!r}")
        if action not in ("drop", "downweight"):
            raise ValueError(f"stale must be 'drop' or 'downweight', got {action!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"stale_decay must be in (0, 1], got {decay!r}")
        self.max_staleness = max_staleness
        self.action: StaleAction = action
        self.decay = decay

    def weight(self, lag: int) -> float:
        """The factor on the advantages of something ``lag`` versions old (1 within bounds)."""
        if self.max_staleness is None or lag <= self.max_staleness:
            return 1.0
        return float(self.decay ** (lag - self.max_staleness))

    def judge(self, oldest: int | None, current: int | None) -> Verdict:
        """The verdict on something whose oldest version is ``oldest``, the trainer being at ``current``."""
        lag = lag_of(oldest, current)
        if lag is None:
            return CURRENT
        if self.max_staleness is None or lag <= self.max_staleness:
            return Verdict(lag)
        if self.action == "drop":
            return Verdict(lag, stale=True, weight=0.0, drop=True)
        return Verdict(lag, stale=True, weight=self.weight(lag))
