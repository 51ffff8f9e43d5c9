"""``rollwire groups``: run a groups worker (Faust) in the foreground.

Reads Kafka settings from ``ROLLWIRE_*`` and the worker's own from ``ROLLWIRE_GROUPS_*`` (settings.py).
Creates the registry's topics and the worker's ``<prefix><app id>-by-task`` topic (the ``tasks`` topic's
partition count) first if they are missing (topics.py).
"""

from __future__ import annotations

import asyncio

from schemas.transport.settings import KafkaSettings


def run() -> None:
    """Run a groups worker: trajectories + evaluations + tasks -> groups with GRPO advantages."""
    from processors.groups.settings import GroupSettings
    from processors.groups.topics import prepare_topics
    from processors.worker.faust_worker import run_worker

    conf, kafka = GroupSettings(), KafkaSettings()
    asyncio.run(prepare_topics(kafka, conf.app_id))
    run_worker("processors.groups.app", conf)
