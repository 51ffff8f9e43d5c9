"""The runtime contract: where a session's harness runs (a workspace, a HOME) and how commands run there.

A :class:`Runtime` turns a task's :class:`~schemas.tasks.RuntimeSpec` into a prepared
:class:`RuntimeHandle` (``init``: workspace checked out at the base commit, set-up commands run). The
gateway node runs the harness through the handle, asks it for the final patch, and tears it down.
Implementations: ``local`` (producers.runtimes.local) and ``docker`` (producers.runtimes.docker).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from producers.errors import RuntimeFailed, RuntimeInitError
from schemas.tasks import RuntimeSpec

__all__ = ["CommandResult", "HarnessFiles", "Runtime", "RuntimeFailed", "RuntimeHandle", "RuntimeInitError"]


@dataclass(frozen=True, slots=True)
class CommandResult:
    """One command's end: exit code (None when killed at its timeout), output tails."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_s: float = 0.0
    oom_killed: bool | None = None
    """The sandbox's memory limit killed a process while the command ran; None where the runtime cannot
    tell (it has no such limit, or the command did not fail)."""
    pids_limit_hit: bool | None = None
    """A fork failed at the sandbox's pids limit while the command ran; None where the runtime cannot tell."""


@dataclass(frozen=True, slots=True)
class HarnessFiles:
    """Files to write before a run, by path relative to the handle's HOME (configs, settings)."""

    files: Mapping[str, str] = field(default_factory=dict)


class RuntimeHandle(abc.ABC):
    """One session's prepared runtime."""

    session_id: str
    workspace: str
    """The workspace path as commands run in the runtime see it (the harness's working directory)."""
    home: str
    """A session-private HOME as commands in the runtime see it."""

    def proxy_url_for(self, proxy_url: str) -> str:
        """The proxy's URL as the harness in this runtime reaches it (a ``relay`` container: its own
        loopback). Called before the harness runs; the docker relay forwards to that proxy from then on."""
        return proxy_url

    @abc.abstractmethod
    async def write_home_files(self, files: Mapping[str, str]) -> None:
        """Write ``files`` (path relative to HOME → text) into the runtime's HOME."""

    @abc.abstractmethod
    async def run(self, argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float,
                  stdin: str | None = None) -> CommandResult:
        """Run ``argv`` in the workspace with exactly ``env`` (plus HOME and PATH the runtime supplies);
        kill the whole process group at ``timeout_s``. Cancellation kills it too."""

    @abc.abstractmethod
    async def patch(self) -> str:
        """The workspace's diff against the base commit, as ``git apply`` takes it: new files included;
        harness config, caches and build output left out."""

    @abc.abstractmethod
    async def teardown(self) -> None:
        """Remove everything the runtime made. Safe to call twice."""


class Runtime(abc.ABC):
    """Makes handles for one kind of runtime."""

    kind: str
    node: str | None = None
    """The gateway node this runtime serves (set by the node; docker labels containers with it)."""

    @abc.abstractmethod
    async def init(self, session_id: str, spec: RuntimeSpec, *, timeout_s: float) -> RuntimeHandle:
        """Prepare a workspace from ``spec``; raises :class:`RuntimeInitError` with the reason."""

    def proxy_url_for(self, proxy_url: str) -> str:
        """The proxy's URL as a harness inside this runtime reaches it, where that is the same for every
        handle; the pipeline asks the handle (:meth:`RuntimeHandle.proxy_url_for`)."""
        return proxy_url
