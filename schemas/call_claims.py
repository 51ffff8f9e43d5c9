"""Call claims (``call-claims``): how a session's model calls get their numbers across a tier of proxies.

Any proxy process may serve any call of a session, so no process can number a session's calls from its own
memory. Before a call is numbered, the process serving it appends a :class:`CallClaim` to the session's
partition of ``call-claims`` (keyed by session, like ``completions``). The log orders the claims, and a
call's ``sequence`` is the count of the session's claims before its own: every process that reads the
partition derives the same numbers, so they are unique and in arrival order whichever processes served
the calls, and a restarted process continues where the log is. Two processes that claim for one session at
the same moment never get the same number: the broker puts one claim first.

A claim also carries the request body's digest and the SDK's retry counter, so that an SDK retry that lands
on another process is still recognised as a retry of the earlier call (``retry_of``), and the claiming
process's name, so that a process can tell which of a session's calls it did not serve (their branches are
then read back from ``completions`` before the session's next call is placed).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from schemas.envelope import Event
from schemas.topics import Topic


class CallClaim(Event):
    """A proxy process is about to number one model call of a session."""

    topic: ClassVar[Topic] = Topic.CALL_CLAIMS
    key_field: ClassVar[str] = "session_id"

    event_type: Literal["call.claimed"] = "call.claimed"
    schema_version: Literal[1] = 1
    session_id: str = Field(min_length=1, description="The session the call belongs to (the record key).")
    proxy: str = Field(min_length=1, max_length=256, description=(
        "The claiming proxy process's name within its tier (ROLLWIRE_PROXY_INSTANCE)."))
    incarnation: str = Field(min_length=1, max_length=64, description=(
        "A random id of the claiming process's run: a process restarted under the same name is another one."))
    request_digest: str | None = Field(default=None, max_length=128, description=(
        "sha256 of the request body, when it was read: an SDK retry sends the same body again."))
    retry_count: int = Field(default=0, ge=0, description="The SDK's own retry counter for the call (0: a first try).")
