"""``rollwire processors`` (run a trajectory worker) and ``rollwire rebuild`` (re-derive trajectories).

Both read Kafka settings from ``ROLLWIRE_*`` (bootstrap, topic prefix, partitions) and the worker's own
from ``ROLLWIRE_PROCESSORS_*`` (see processors/trajectories/settings.py).
"""

from __future__ import annotations

import asyncio
from datetime import datetime

import typer


def run() -> None:
    """Run a trajectory worker (Faust) in the foreground: completions + session events -> trajectories."""
    from processors.worker.faust_worker import run_worker
    from processors.trajectories.settings import ProcessorSettings
    from processors.trajectories.topics import prepare_topics
    from schemas.transport.settings import KafkaSettings

    conf, kafka = ProcessorSettings(), KafkaSettings()
    asyncio.run(prepare_topics(kafka, conf.app_id))
    run_worker("processors.trajectories.app", conf)


def rebuild(builder: str = typer.Option(..., "--builder", help="per_request or prefix_merging."),
            to: str = typer.Option(..., "--to", help="Topic to write the trajectories to (created if missing)."),
            since: datetime | None = typer.Option(None, "--from", help="Only sessions whose first event is "
                                                  "at or after this time (ISO 8601; UTC if no zone)."),
            sessions: list[str] | None = typer.Option(None, "--sessions", help="Only these session ids "
                                                      "(repeat the option)."),
            ) -> None:
    """Re-derive trajectories from the retained completion and session events, e.g. with another builder."""
    from processors.trajectories.rebuild import RebuildRequest, rebuild as do_rebuild
    from schemas.transport.settings import KafkaSettings

    result = asyncio.run(do_rebuild(KafkaSettings(), RebuildRequest(builder=builder, to_topic=to, since=since,
                                                                   sessions=frozenset(sessions or ()))))
    for name, value in result.items():
        typer.echo(f"{name}={value}")
