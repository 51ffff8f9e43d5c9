"""Tasks: the TaskRequest API model a trainer submits, and the `task.accepted` event on `tasks`.

The specs here (runtime, agent, engine parameters, evaluator) are shared with the session spec: a task
is expanded into ``num_samples`` sessions that each carry a copy of them.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from schemas.envelope import Event, Model, new_event_id
from schemas.topics import Topic

BuilderName = Literal["per_request", "prefix_merging"]
HarnessName = Literal["codex", "claude-code", "qwen-code", "pi", "gemini-cli", "opencode", "command"]
NetworkMode = Literal["relay", "host", "none"]

_MEMORY = re.compile(r"^([0-9]+)([bkmg]?)$", re.IGNORECASE)
_MEMORY_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
MIN_MEMORY_BYTES = 6 * (1 << 20)
"""Docker's own floor for a container's memory limit."""


def memory_bytes(text: str) -> int:
    """Docker's memory notation (``512m``, ``2g``, ``1048576``; units b/k/m/g, case-insensitive) in bytes."""
    match = _MEMORY.match(text.strip())
    if match is None:
        raise ValueError(f"memory {text!r}: expected a whole number with an optional unit b, k, m or g "
                         "(e.g. '512m', '2g')")
    return int(match.group(1)) * _MEMORY_UNITS[match.group(2).lower()]


class ImageBuild(Model):
    """How the docker runtime makes ``runtime.image`` when the engine does not have it: ``docker build`` of a
    folder on the machine that runs the session (nothing is pulled: every base image must be on the engine)."""

    context: str = Field(min_length=1, description="The build context: an absolute folder path on the machine "
                         "that runs the session (a Harbor task's environment/).")
    dockerfile: str = Field(default="Dockerfile", min_length=1, description="The Dockerfile, relative to context.")
    timeout_s: float = Field(default=600.0, gt=0, description="How long the build may take.")
    snapshot_workdir: bool = Field(default=True, description=(
        "Commit the image's WORKDIR as a git repository in a last layer (unless it is one already), so that a "
        "session's changes are its diff against that commit. Needs git in the image and a WORKDIR other "
        "than /."))


class RuntimeSpec(Model):
    """Where a session's harness runs and what its workspace starts from."""

    kind: Literal["local", "docker"] = "local"
    repo: str | None = Field(default=None, description="Git repository path or URL to check out.")
    base_commit: str | None = None
    setup: list[str] = Field(default_factory=list, description="Shell commands run once in the workspace.")
    image: str | None = Field(default=None, description="Container image (docker runtime only).")
    build: ImageBuild | None = Field(default=None, description=(
        "How to build ``image`` when the engine lacks it (docker only); a failed build fails the session's "
        "init with the reason."))
    workdir: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    mounts: list[str] = Field(default_factory=list, description="'host:container[:ro]' (docker only).")
    network: NetworkMode = Field(default="relay", description=(
        "How a container reaches the proxy (docker only). 'relay': the container has no network; the "
        "proxy is relayed through a Unix socket and seen at http://127.0.0.1:<port> inside. 'host': the "
        "host's network. 'none': no network and no proxy."))
    cpus: float | None = Field(default=None, gt=0, description="CPUs the container may use (docker only); "
                               "None: unlimited.")
    memory: str | None = Field(default=None, description="Memory limit, docker notation ('512m', '2g'), swap "
                               "included (docker only); None: unlimited.")
    pids_limit: int | None = Field(default=None, ge=1, description="Processes the container may hold (docker "
                                   "only); None: the runtime's default (4096).")

    @field_validator("memory")
    @classmethod
    def _memory_is_docker_notation(cls, value: str | None) -> str | None:
        if value is not None and memory_bytes(value) < MIN_MEMORY_BYTES:
            raise ValueError(f"memory {value!r}: below docker's minimum of 6m")
        return value

    @model_validator(mode="after")
    def _docker_needs_image(self) -> RuntimeSpec:
        if self.kind == "docker" and not self.image:
            raise ValueError("runtime.kind 'docker' needs runtime.image")
        return self


class AgentSpec(Model):
    """Which harness runs the session, against which model name, with which settings."""

    harness: HarnessName
    model: str = Field(default="rollwire-tiny", min_length=1)
    settings: dict[str, Any] = Field(default_factory=dict)
    command: str | None = Field(default=None, description=(
        "For harness 'command': a command line with {base_url}, {api_key}, {model}, {instruction}."))

    @model_validator(mode="after")
    def _command_needs_template(self) -> AgentSpec:
        if self.harness == "command" and not self.command:
            raise ValueError("agent.harness 'command' needs agent.command")
        return self


class EngineParams(Model):
    """Sampling parameters the session fixes; they override whatever the harness sends."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    extra: dict[str, Any] = Field(default_factory=dict, description=(
        "Engine-specific request fields passed through verbatim, e.g. vLLM's structured_outputs."))
    turns: list[dict[str, Any]] = Field(default_factory=list, description=(
        "Per-turn engine fields, merged over `extra`: entry N applies to a call whose prompt already holds "
        "N assistant turns (the last entry to every later one). Scripts a session's outputs, e.g. a forced "
        "tool call on the first turn and a forced answer on the second, through structured outputs."))
    continuation: Literal["exact", "rendered"] = Field(default="exact", description=(
        "How the proxy builds each prompt. 'exact': a call that continues one of the session's branches is "
        "sent to the engine as that branch's exact tokens (prompt + sampled) + the tokens of only the new "
        "messages + the generation prompt, so the trained row is what the engine conditioned on; "
        "'rendered': every prompt is the chat template's rendering of the whole history (the harness's "
        "echo of sampled text re-tokenized)."))


class EvaluatorSpec(Model):
    """Which evaluator scores the session, and its settings."""

    name: str = Field(min_length=1)
    settings: dict[str, Any] = Field(default_factory=dict)


class TaskRequest(Model):
    """What a trainer submits: one task, expanded into ``num_samples`` sessions (a GRPO group)."""

    task_id: str = Field(default_factory=new_event_id, min_length=1, max_length=128)
    instruction: str = Field(min_length=1)
    num_samples: int = Field(default=1, ge=1, le=1024)
    timeout_s: float = Field(default=1800.0, gt=0)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    agent: AgentSpec
    builder: BuilderName = "prefix_merging"
    evaluator: EvaluatorSpec | None = None
    engine: EngineParams = Field(default_factory=EngineParams)
    group_id: str | None = None
    policy_version: str | None = Field(default=None, description=(
        "The policy the task's sessions must be sampled under, copied onto each session's spec. A version "
        "number ('7' or 'v7': the engine's weight version, see schemas.policy) is a floor: the proxy holds "
        "each call of these sessions until the engine serves that version or a newer one. Any other label "
        "('step-12') is recorded but sets no floor. A value written like a version that is not one ('v', "
        "'v-1', '-3', 'V7', '1.5') is refused."))
    metadata: dict[str, Any] = Field(default_factory=dict)
    callback_url: str | None = None
    max_retries: int | None = Field(default=None, ge=0, le=10, description=(
        "How many times a sample whose session failed for the infrastructure (schemas.attribution) is "
        "resubmitted as a new session. Unset: the rollout server's ROLLWIRE_ROLLOUT_MAX_RETRIES, written "
        "into the accepted request so that every reader of the log sees the same number."))


class TaskAccepted(Event):
    """A task as the rollout server accepted it, with the ids of the sessions it expanded into."""

    topic: ClassVar[Topic] = Topic.TASKS
    key_field: ClassVar[str] = "task_id"

    event_type: Literal["task.accepted"] = "task.accepted"
    schema_version: Literal[1] = 1
    task_id: str
    request: TaskRequest
    session_ids: list[str]
