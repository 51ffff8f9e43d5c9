"""Expanding an accepted TaskRequest into its `task.accepted` event and one SessionSpec per sample.

Session ids are derived from the task id and the sample index (``{task_id}-s{index}``), so that the
same task always names the same sessions; each session gets a fresh random API key, the only thing the
harness needs to reach the proxy. Pure functions: no Kafka here.

A task's ``policy_version`` goes onto every session's spec unchanged. When it is a version number (``7``
or ``v7``, see schemas.policy.version_number) it is a floor: the proxy holds the session's calls until the
engine serves that version or a newer one. Any other label (``step-12``) is recorded, not enforced. A value
that looks like a version but is not one (``v``, ``v-1``, ``-3``, ``V7``, ``1.5``, a number too large) is
refused, so that a typo never silently drops the floor.
"""

from __future__ import annotations

import hashlib
import re
import secrets

import httpx

from producers.rollout.errors import InvalidTask
from schemas.policy import version_number
from schemas.sessions import SessionSpec
from schemas.tasks import TaskAccepted, TaskRequest

# Session ids appear in proxy paths (/s/{session_id}/v1) and topic keys: keep them URL-path safe.
TASK_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
MAX_SESSION_ID = 128  # SessionSpec.session_id's limit
# What a version is written like, well formed or not: an optional v, an optional sign, digits and dots.
_VERSION_LIKE = re.compile(r"^[vV]?[-+]?[0-9.]*$")


def check_request(request: TaskRequest) -> None:
    """Refuse what the schema allows but the rollout cannot run; raises InvalidTask naming the field."""
    if not TASK_ID_PATTERN.match(request.task_id):
        raise InvalidTask(("body", "task_id"), "must start with a letter or digit and hold only letters, "
                          f"digits, '.', '_', ':' and '-' (it names sessions in URLs); got {request.task_id!r}")
    if request.callback_url is not None:
        try:
            url = httpx.URL(request.callback_url)
        except (httpx.InvalidURL, TypeError) as exc:
            raise InvalidTask(("body", "callback_url"), f"not a URL: {exc}") from exc
        if url.scheme not in ("http", "https") or not url.host:
            raise InvalidTask(("body", "callback_url"), "must be an absolute http:// or https:// URL; "
                              f"got {request.callback_url!r}")
    if request.runtime.kind == "local" and request.runtime.image:
        raise InvalidTask(("body", "runtime", "image"), "an image needs runtime.kind 'docker'")
    check_policy_version(request.policy_version)


def check_policy_version(policy_version: str | None) -> int | None:
    """The floor a task's ``policy_version`` sets (None: no floor, absent or a plain label); raises
    InvalidTask for a value written like a version that is not one (see the module docstring)."""
    if policy_version is None:
        return None
    floor = version_number(policy_version)
    if floor is not None:
        return floor
    text = policy_version.strip()
    if text and _VERSION_LIKE.match(text):
        raise InvalidTask(("body", "policy_version"), "a policy version floor is a whole number of at most 18 "
                          f"digits, optionally written v7; got {policy_version!r} (a label that is no version, "
                          "such as 'step-12', sets no floor)")
    return None


def session_id(task_id: str, sample_index: int) -> str:
    """The id of sample ``sample_index`` of task ``task_id`` (stable; at most 128 characters)."""
    suffix = f"-s{sample_index}"
    if len(task_id) + len(suffix) <= MAX_SESSION_ID:
        return task_id + suffix
    digest = hashlib.sha256(task_id.encode("utf-8")).hexdigest()[:12]
    return f"{task_id[:MAX_SESSION_ID - len(suffix) - 13]}-{digest}{suffix}"


def new_api_key() -> str:
    """A fresh session-scoped API key."""
    return "rw-" + secrets.token_urlsafe(24)


def expand(request: TaskRequest, source: str | None = None,
           max_retries: int = 0) -> tuple[TaskAccepted, list[SessionSpec]]:
    """The task's accepted event and its sessions' specs, in sample order; a request that names no
    ``max_retries`` is accepted with ``max_retries`` (the server's default) written into it."""
    if request.max_retries is None:
        request = request.model_copy(update={"max_retries": max_retries})
    specs = [
        SessionSpec(
            session_id=session_id(request.task_id, index),
            task_id=request.task_id,
            sample_index=index,
            origin="rollout",
            instruction=request.instruction,
            runtime=request.runtime,
            agent=request.agent,
            builder=request.builder,
            evaluator=request.evaluator,
            engine=request.engine,
            timeout_s=request.timeout_s,
            api_key=new_api_key(),
            group_id=request.group_id,
            policy_version=request.policy_version,
            metadata=request.metadata,
            source=source,
        )
        for index in range(request.num_samples)
    ]
    accepted = TaskAccepted(task_id=request.task_id, request=request,
                            session_ids=[spec.session_id for spec in specs], source=source)
    return accepted, specs
