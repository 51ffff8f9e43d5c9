"""Trajectory builders: plain functions from a session's completion events to its Trajectory event.

A Faust agent (or ``rollwire rebuild``) looks the session's builder up by name here and calls it when the
session ends; nothing in this package touches Kafka.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from processors.builders import per_request, prefix_merging
from processors.builders.common import Builder, SessionFacts
from processors.errors import UnknownBuilder
from schemas.completions import Completion
from schemas.tasks import BuilderName
from schemas.trajectories import Trajectory

__all__ = ["BUILDERS", "Builder", "SessionFacts", "UnknownBuilder", "build_trajectory", "get_builder"]

BUILDERS: Mapping[str, Builder] = MappingProxyType({
    per_request.NAME: per_request.build,
    prefix_merging.NAME: prefix_merging.build,
})


def get_builder(name: BuilderName | str) -> Builder:
    """The builder registered under ``name``; raises UnknownBuilder naming the known ones."""
    try:
        return BUILDERS[name]
    except KeyError:
        raise UnknownBuilder(f"unknown builder {name!r}; use one of {sorted(BUILDERS)}") from None


def build_trajectory(name: BuilderName | str, completions: Iterable[Completion], facts: SessionFacts) -> Trajectory:
    """Build ``facts.session_id``'s trajectory from its completions with the builder called ``name``."""
    return get_builder(name)(completions, facts)
