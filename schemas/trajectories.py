"""Trajectories: a session's calls built into training sequences, on `trajectories`.

A trace is one token sequence with a loss mask (1 = sampled by the policy, trained on; 0 = context such
as the prompt, tool results and template glue) and the engine's logprobs (NaN where the mask is 0).

Every field added after the first release has a default, so trajectory events written before it still
decode (``cut_turns`` empty, ``role`` "main", the newer stats zero or empty).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from schemas.arrays import Logprobs, LossMask, TokenIds
from schemas.completions import BranchRole
from schemas.envelope import Event, Model
from schemas.policy import PolicyRange
from schemas.sessions import FailureKind, SessionStatus
from schemas.tasks import BuilderName
from schemas.topics import Topic


class Trace(Model):
    """One training sequence built from one or more completions of a session."""

    trace_id: str
    branch: int = Field(ge=0, description="Branch number within the session (0 = first chain).")
    parent_branch: int | None = None
    completion_ids: list[str] = Field(description="Event ids of the completions merged into this trace.")
    sequences: list[int] = Field(description="Their per-session sequence numbers.")
    token_ids: TokenIds
    loss_mask: LossMask
    logprobs: Logprobs
    truncated: bool = Field(default=False, description="The last turn stopped at the length limit.")
    cut_turns: list[int] = Field(default_factory=list, description=(
        "Sequences of the trace's turns that stopped at the length limit (finish_reason 'length'), the last "
        "turn included: a cut turn in the middle was continued past the cut (the proxy may have added the "
        "template's close token, mask 0)."))
    role: BranchRole = Field(default="main", description=(
        "The branch's role as the proxy recorded it (the first of its calls with a continuation block); "
        "'main' for calls recorded without one."))

    @model_validator(mode="after")
    def _aligned(self) -> Trace:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"token_ids ({n}), loss_mask ({len(self.loss_mask)}) and logprobs "
                             f"({len(self.logprobs)}) must have the same length")
        return self


class TrajectoryStats(Model):
    """What a builder did with a session's calls, and how the proxy had built their prompts."""

    completions: int = 0
    traces: int = 0
    merged: int = 0
    branches: int = 0
    retries: int = 0
    truncated: int = 0
    cut_turns: int = Field(default=0, ge=0, description="Turns cut at the length limit, over all traces.")
    rejected: int = 0
    missing_logprobs: int = 0
    abandoned: list[int] = Field(default_factory=list, description=(
        "Sequences of retried attempts whose sample was dropped (another attempt at the turn was kept)."))
    roles: dict[str, int] = Field(default_factory=dict, description="Traces per branch role.")
    exact_calls: int = Field(default=0, ge=0, description="Usable calls whose prompt was an exact continuation.")
    drift: dict[str, int] = Field(default_factory=dict, description=(
        "Usable calls per drift kind of their re-render, plus 'none' for exact calls whose re-render matched."))
    closed_cut_turns: int = Field(default=0, ge=0, description=(
        "Usable calls whose parent turn was cut and closed by the proxy with a token never sampled."))
    problems: list[str] = Field(default_factory=list, description="Ambiguities reported, not guessed.")


class Trajectory(Event):
    """All traces of one session, as one builder made them."""

    topic: ClassVar[Topic] = Topic.TRAJECTORIES
    key_field: ClassVar[str] = "session_id"

    event_type: Literal["trajectory"] = "trajectory"
    schema_version: Literal[1] = 1
    session_id: str = Field(min_length=1)
    task_id: str | None = None
    builder: BuilderName
    policy_version: str | None = None
    policy_versions: PolicyRange | None = Field(default=None, description=(
        "The oldest and newest engine weight version its completions' tokens were sampled under."))
    session_status: SessionStatus | None = None
    failure: FailureKind | None = None
    partial: bool = Field(default=False, description="Built before the session ended (deadline passed).")
    traces: list[Trace]
    stats: TrajectoryStats = Field(default_factory=TrajectoryStats)
