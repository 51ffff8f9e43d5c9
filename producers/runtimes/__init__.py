"""Runtimes by kind: ``runtime_for("local" | "docker")`` gives the :class:`Runtime` for a RuntimeSpec.kind."""

from __future__ import annotations

from collections.abc import Callable

from producers.runtimes.base import Runtime

RUNTIME_KINDS: tuple[str, ...] = ("local", "docker")


def _local() -> Runtime:
    from producers.runtimes.local import LocalRuntime
    return LocalRuntime()


def _docker() -> Runtime:
    from producers.runtimes.docker import DockerRuntime
    return DockerRuntime()


_FACTORIES: dict[str, Callable[[], Runtime]] = {"local": _local, "docker": _docker}


def runtime_for(kind: str) -> Runtime:
    """A new runtime of ``kind`` with its defaults (session root from ``ROLLWIRE_RUNTIME_ROOT``)."""
    factory = _FACTORIES.get(kind)
    if factory is None:
        raise ValueError(f"unknown runtime kind {kind!r}; known: {', '.join(RUNTIME_KINDS)}")
    return factory()
