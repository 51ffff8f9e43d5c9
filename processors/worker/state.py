"""Where a Faust worker keeps its RocksDB tables: one folder per Kafka cluster.

The tables are a local copy of their changelog topics, so they are only valid against the cluster that
holds those changelogs. A broker whose data was wiped and recreated (a new local stack, a cleared
``ROLLWIRE_HOME/kafka``) has a new cluster id; state kept under the old id would make Faust stop with a
ConsistencyError (persisted offsets beyond the new changelogs' ends). Keyed by cluster id, the worker
starts clean there and recovers from the changelogs as usual. Within it each app id (topic prefix and
worker name) has its own folder (processors.worker.faust_worker.app_settings): another deployment's prefix on the
same cluster has other changelogs.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from schemas.transport.admin import cluster_id


async def cluster_state_dir(base: Path, bootstrap: str) -> Path:
    """``base/cluster-<id>``, created; TransportError if the cluster does not say its id."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", await cluster_id(bootstrap))
    path = base / f"cluster-{safe}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cluster_state_dir_now(base: Path, bootstrap: str) -> Path:
    """:func:`cluster_state_dir` from synchronous code, on an event loop of its own (the thread's current
    loop, which the worker runs on later, is neither made nor set here)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(cluster_state_dir(base, bootstrap))
    finally:
        loop.close()
