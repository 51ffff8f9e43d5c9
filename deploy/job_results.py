"""What the main job reads back once its sessions are over: the run's GRPO groups (from `groups`) and its
SFT dataset (the SFT store over this run's completions, trajectories and evaluations).

Both read the log with no consumer group (nothing is committed) and keep only this run's tasks and
sessions, so a shared topic prefix with other runs' events gives the same answer as a private one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from schemas.completions import Completion
from schemas.evaluations import Evaluation
from schemas.groups import Group
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport.consumer import EventConsumer
from schemas.transport.settings import KafkaSettings
from sinks.sft import PARQUET_FILE, ROWS_FILE, STATS_FILE, SftCriteria, SftStore


async def read_groups(kafka: KafkaSettings, task_ids: Collection[str], expected: Collection[str],
                      wait_s: float) -> dict[str, Group]:
    """The groups of ``task_ids`` on `groups` (one per task; a re-emitted group replaces the earlier one).

    Reads to the end of the topic, then keeps reading until every task in ``expected`` has its group or
    ``wait_s`` has passed."""
    wanted = set(task_ids)
    groups: dict[str, Group] = {}
    deadline = time.monotonic() + wait_s
    async with EventConsumer(kafka, [Topic.GROUPS], group_id=None, service="rollout-job",
                             from_beginning=True, dead_letters=False) as consumer:
        while True:
            received = await consumer.getmany(timeout_ms=500)
            for item in received:
                event = item.event
                if isinstance(event, Group) and event.task_id in wanted:
                    groups[event.task_id] = event
            caught_up = not received and await consumer.lag() == 0
            if caught_up and (set(expected) <= groups.keys() or time.monotonic() > deadline):
                return groups


async def build_sft(kafka: KafkaSettings, session_ids: Collection[str], out_dir: Path,
                    criteria: SftCriteria) -> dict[str, Any]:
    """Run the SFT store over the log, keeping only ``session_ids``' events; returns its statistics
    (accepted / attempted and the row count), with the files it wrote under ``files``."""
    sessions = set(session_ids)
    store = SftStore(out_dir, criteria)
    try:
        async with EventConsumer(kafka, [Topic.COMPLETIONS, Topic.TRAJECTORIES, Topic.EVALUATIONS], group_id=None,
                                 service="rollout-job-sft", from_beginning=True, dead_letters=False) as consumer:
            while True:
                received = await consumer.getmany(timeout_ms=500)
                for item in received:
                    event = item.event
                    if isinstance(event, (Completion, Trajectory, Evaluation)) and event.session_id in sessions:
                        store.take(event)
                if received:
                    store.retry_pending()
                elif await consumer.lag() == 0:
                    stats = store.finish()
                    break
    finally:
        store.close()
    stats["files"] = {name: str(out_dir / name) for name in (ROWS_FILE, PARQUET_FILE, STATS_FILE)}
    return stats


def collect(kafka: KafkaSettings, task_ids: Collection[str], session_ids: Collection[str],
            expected_groups: Collection[str], group_wait_s: float, sft_dir: Path,
            criteria: SftCriteria) -> tuple[dict[str, Group], dict[str, Any]]:
    """Both of the above (from synchronous code)."""

    async def both() -> tuple[dict[str, Group], dict[str, Any]]:
        groups = await read_groups(kafka, task_ids, expected_groups, group_wait_s)
        return groups, await build_sft(kafka, session_ids, sft_dir, criteria)

    return asyncio.run(both())
