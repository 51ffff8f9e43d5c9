"""Policy versions: which weights sampled a token, and the weight updates that change them.

A policy version is the engine's weight version (vLLM's ``/update_weight_version``; ``/weight_info`` reads
it back). rollwire's trainer numbers its pushes 1, 2, 3, …, so versions are compared as integers: a
version string is a whole number, optionally written ``v7``. The engine's initial weights are version 0
(vLLM reports no version before the first update). Completions carry the version their tokens were
sampled under (from the engine), trajectories and groups the range of versions they contain, and the
``policy`` topic one :class:`WeightsUpdated` event per push.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, model_validator

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


class WeightsUpdated(Event):
    """One push of new weights into a running engine, as the proxy that coordinated it saw it."""

    topic: ClassVar[Topic] = Topic.POLICY
    key_field: ClassVar[str] = "served_model"

    event_type: Literal["policy.weights_updated"] = "policy.weights_updated"
    schema_version: Literal[1] = 1
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
