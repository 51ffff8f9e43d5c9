"""Policy versions: which weights sampled a token, and the weight updates that change them.

A policy version is the engine's weight version (vLLM's ``/update_weight_version``; ``/weight_info`` reads
it back). rollwire's trainer numbers its pushes 1, 2, 3, …, so versions are compared as integers: a
version string is a whole number, optionally written ``v7``. The engine's initial weights are version 0
(vLLM reports no version before the first update). Completions carry the version their tokens were
sampled under (from the engine), trajectories and groups the range of versions they contain, and the
``policy`` topic one :class:`WeightsUpdated` event per push.

The ``policy`` topic also carries how the proxy tier agrees on a push (every proxy process in front of
the engines holds its calls while they change): each process's :class:`ProxyAlive` heartbeat, and a
push's :class:`TierGate` events, closed by the process coordinating it, acknowledged by each process
once its calls in flight are done, opened again by the coordinator (the protocol: ``proxy/policy_tier.py``).
Readers that want the pushes alone take the :class:`WeightsUpdated` events.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.envelope import Event, Model
from schemas.topics import Topic

INITIAL_VERSION = 0
_VERSION = re.compile(r"^v?(\d{1,18})$")


def version_number(version: str | int | None) -> int | None:
    """The integer of a policy version (``"7"``, ``"v7"`` or 7); None when absent or not a number."""
    if version is None:
        return None
    if isinstance(version, int):
        return version if version >= 0 else None
    match = _VERSION.match(version.strip())
    return int(match.group(1)) if match else None


class PolicyRange(Model):
    """The oldest and newest policy version among the tokens something contains."""

    oldest: int = Field(ge=0)
    newest: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> PolicyRange:
        if self.oldest > self.newest:
            raise ValueError(f"oldest version {self.oldest} is after newest {self.newest}")
        return self

    @classmethod
    def over(cls, versions: list[int]) -> PolicyRange | None:
        return cls(oldest=min(versions), newest=max(versions)) if versions else None

    def merged(self, other: PolicyRange | None) -> PolicyRange:
        if other is None:
            return self
        return PolicyRange(oldest=min(self.oldest, other.oldest), newest=max(self.newest, other.newest))


class EngineUpdate(BaseModel):
    """One engine's part of a weight update."""

    model_config = ConfigDict(extra="forbid")

    engine: str = Field(description="The engine's id (its configured name, else its URL).")
    status: Literal["ok", "failed", "rolled_back"] = "ok"
    load_ms: float = Field(default=0.0, ge=0, description="Pausing, loading, versioning and resuming it.")
    error: str | None = None


class ProxyDrain(BaseModel):
    """One proxy process's part of a weight update: whether its calls in flight finished before the engines
    changed."""

    model_config = ConfigDict(extra="forbid")

    instance: str = Field(min_length=1, description="The process's name within the tier (ROLLWIRE_PROXY_INSTANCE).")
    status: Literal["drained", "drain_timeout", "absent"] = Field(default="drained", description=(
        "`drained`: its calls in flight finished and it held new ones; `drain_timeout`: some still ran after "
        "the update's drain_timeout_s (the update fails); `absent`: no acknowledgement came (the process died, "
        "stopped, or did not answer in time; `error` says which), and the update went on without it."))
    drained_calls: int = Field(default=0, ge=0, description="Its calls in flight when it closed its gate.")
    held_calls: int = Field(default=0, ge=0, description=(
        "Calls it held, counted when it acknowledged (the coordinator's own: over the whole update)."))
    error: str | None = None


class WeightsUpdated(Event):
    """One push of new weights into a running engine, as the proxy that coordinated it saw it.

    Schema version 2 adds the tier: ``update_id``, ``coordinator`` and each proxy process's part
    (``proxies``); a version-1 event is a push by one proxy process that said nothing of the others."""

    topic: ClassVar[Topic] = Topic.POLICY
    key_field: ClassVar[str] = "served_model"

    event_type: Literal["policy.weights_updated"] = "policy.weights_updated"
    schema_version: Literal[1, 2] = 2
    served_model: str = Field(min_length=1, description="The engine's model name (the record key).")
    version: str = Field(description="The version now serving.")
    previous_version: str | None = None
    weights_path: str | None = Field(default=None, description="Where the engine loaded the weights from.")
    status: Literal["ok", "failed"] = "ok"
    error: str | None = None
    paused_ms: float = Field(ge=0, description="How long new calls were held.")
    load_ms: float = Field(default=0.0, ge=0, description="Of which the engine spent loading the weights.")
    held_calls: int = Field(default=0, ge=0, description="Calls that arrived during the update and waited.")
    drained_calls: int = Field(default=0, ge=0, description=(
        "Calls in flight when the update began, finished on the previous version before the weights changed."))
    engines: list[EngineUpdate] = Field(default_factory=list, description=(
        "Each engine of the pool and its part of the update (all or none of them serve the new version)."))
    update_id: str | None = Field(default=None, description="The update's id on its TierGate events.")
    coordinator: str | None = Field(default=None, description="The proxy process that received the push.")
    proxies: list[ProxyDrain] = Field(default_factory=list, description=(
        "Each proxy process the update waited for (the tier's live processes when it began) and its part; "
        "held_calls and drained_calls above are their sums."))


class TierGate(Event):
    """One phase of a weight update across the proxy tier, on the ``policy`` topic.

    ``close``: the coordinator begins an update; every process closes its gate (new calls wait) and drains.
    ``drained``: a process's acknowledgement (``drain``), written once its calls in flight are done.
    ``open``: the coordinator ends the update (``status``); every process reopens its gate at ``version``."""

    topic: ClassVar[Topic] = Topic.POLICY
    key_field: ClassVar[str] = "served_model"

    event_type: Literal["policy.gate"] = "policy.gate"
    schema_version: Literal[1] = 1
    served_model: str = Field(min_length=1, description="The model the tier serves (the record key).")
    update_id: str = Field(min_length=1, max_length=128)
    coordinator: str = Field(min_length=1, description="The proxy process that coordinates the update.")
    instance: str = Field(min_length=1, description="The proxy process that writes this event.")
    phase: Literal["close", "drained", "open"]
    version: str | None = Field(default=None, description=(
        "close: the version the update loads; open: the version the engines serve now."))
    weights_path: str | None = Field(default=None, description=(
        "close: the checkpoint it loads; open with status ok: the checkpoint now serving."))
    drain_timeout_s: float | None = Field(default=None, gt=0, description=(
        "close: how long each process lets its calls in flight run before its drain fails."))
    hold_limit_s: float | None = Field(default=None, gt=0, description=(
        "close: the longest a process keeps its gate closed for this update without its open (a coordinator "
        "that died without saying so): then it reopens on its own and logs why."))
    drain: ProxyDrain | None = Field(default=None, description="drained: the writer's part.")
    status: Literal["ok", "failed", "withdrawn"] | None = Field(default=None, description=(
        "open: `ok` (the engines serve the new version), `failed` (they serve the previous one), `withdrawn` "
        "(another update's close came first in the log: this one never ran)."))
    error: str | None = None


class ProxyAlive(Event):
    """A proxy process's heartbeat on the ``policy`` topic: the tier's membership, for weight updates."""

    topic: ClassVar[Topic] = Topic.POLICY
    key_field: ClassVar[str] = "served_model"

    event_type: Literal["policy.proxy_alive"] = "policy.proxy_alive"
    schema_version: Literal[1] = 1
    served_model: str = Field(min_length=1, description="The model the tier serves (the record key).")
    instance: str = Field(min_length=1, description="The process's name within the tier (ROLLWIRE_PROXY_INSTANCE).")
    timeout_s: float = Field(gt=0, description=(
        "Not heard from again within this long, the process is taken for gone (ROLLWIRE_PROXY_TIER_TIMEOUT_S)."))
    updating: str | None = Field(default=None, description="The update it coordinates now, if any.")
    leaving: bool = Field(default=False, description="The process is stopping: no update waits for it.")
