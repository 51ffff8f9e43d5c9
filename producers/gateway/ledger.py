"""What ``session-events`` says about each session, and who may run a session a node has been handed.

Every gateway node follows ``session-events`` from the beginning (as the proxy's registry does) and keeps,
per session, whether it ended and its last stage and node. Before a node runs a session it was handed,
it reads this ledger up to the log's end (:meth:`SessionLedger.sync`) and asks :func:`decide`:

- the session ended → skip it (a redelivered spec never runs twice);
- no node claimed it (no stage past ``queued``) → run it;
- another node claimed it (``init`` or later) and that node is still a member of the consumer group → wait:
  it keeps running sessions whose partitions moved away in a rebalance, and the end will appear;
- the node that claimed it is gone: if it had not started the harness (``init``, ``ready``) → run it again
  (no model call was made, nothing is lost); if it had (``running`` and later) → end it as an
  infrastructure failure (a second run would mix two runs' completions into one session's trajectory).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from dataclasses import dataclass

from schemas.sessions import SessionEnded, SessionStage, SessionStageChanged
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaAdmin, KafkaSettings
from schemas.transport.errors import TransportError

logger = logging.getLogger(__name__)

CLAIMED_STAGES = frozenset({SessionStage.INIT, SessionStage.READY, SessionStage.RUNNING,
                            SessionStage.POST_RUN, SessionStage.TEARDOWN})
"""A node that emitted one of these for a session has taken it: nobody else may start it while it lives."""
HARNESS_STARTED_STAGES = frozenset({SessionStage.RUNNING, SessionStage.POST_RUN, SessionStage.TEARDOWN})
"""The harness may have called the model: the session cannot be run again under the same id."""


@dataclass(slots=True)
class SessionRecord:
    """One session as its lifecycle events describe it."""

    ended: bool = False
    stage: SessionStage | None = None
    node: str | None = None


class Decision(str, enum.Enum):
    """What a node does with a session it was handed."""

    RUN = "run"
    SKIP = "skip"
    WAIT = "wait"
    END_ORPHANED = "end_orphaned"


def decide(record: SessionRecord | None, *, node: str, live_nodes: frozenset[str] | None) -> Decision:
    """The rule in this module's docstring. ``live_nodes``: the group's members by node name (None: not
    looked up yet, which only matters when another node claimed the session)."""
    if record is None or record.stage is None:
        return Decision.RUN
    if record.ended:
        return Decision.SKIP
    if record.stage not in CLAIMED_STAGES:
        return Decision.RUN
    # A claim under this node's own name that this node does not hold is a previous incarnation's.
    owner_alive = record.node != node and live_nodes is not None and record.node in live_nodes
    if record.node != node and live_nodes is None:
        return Decision.WAIT
    if owner_alive:
        return Decision.WAIT
    return Decision.END_ORPHANED if record.stage in HARNESS_STARTED_STAGES else Decision.RUN


class SessionLedger:
    """A background reader of ``session-events`` into :class:`SessionRecord` per session."""

    def __init__(self, settings: KafkaSettings, *, service: str = "gateway-ledger") -> None:
        self.settings = settings
        self._service = service
        self._records: dict[str, SessionRecord] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._task: asyncio.Task[None] | None = None
        self._consumer: EventConsumer | None = None

    def get(self, session_id: str) -> SessionRecord | None:
        return self._records.get(session_id)

    def apply(self, event: object) -> None:
        """Take one lifecycle event into the ledger (an end is final; stages after it change nothing)."""
        if isinstance(event, SessionStageChanged):
            record = self._records.setdefault(event.session_id, SessionRecord())
            if not record.ended:
                record.stage, record.node = event.stage, event.node
        elif isinstance(event, SessionEnded):
            self._records.setdefault(event.session_id, SessionRecord()).ended = True

    async def start(self) -> None:
        self._consumer = EventConsumer(self.settings, [Topic.SESSION_EVENTS], group_id=None,
                                       service=self._service, dead_letters=False)
        await self._consumer.start()
        self._task = asyncio.create_task(self._follow(self._consumer), name="gateway-ledger")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(TransportError("session ledger stopped"))

    async def sync(self, timeout_s: float = 30.0) -> None:
        """Return once the ledger holds every event that was on the log when this was called."""
        if self._task is None or self._task.done():
            raise TransportError("session ledger is not running")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError as exc:
            raise TransportError(f"session-events not read up to its end within {timeout_s:g}s") from exc

    async def _follow(self, consumer: EventConsumer) -> None:
        while True:
            # Waiters registered before this read are satisfied once a read after them finds no lag:
            # the end offsets lag() compares against are at least those of the moment they asked.
            waiting, self._waiters = self._waiters, []
            try:
                for received in await consumer.getmany(timeout_ms=50 if waiting else 300):
                    self.apply(received.event)
                caught_up = await consumer.lag() == 0 if waiting else False
            except TransportError as exc:
                logger.warning("session ledger: %s; retrying", exc)
                caught_up = False
                await asyncio.sleep(1)
            if caught_up:
                for waiter in waiting:
                    if not waiter.done():
                        waiter.set_result(None)
            else:
                self._waiters = waiting + self._waiters


class GroupMembers:
    """Which gateway nodes are members of the consumer group now (by the client id each one uses)."""

    def __init__(self, settings: KafkaSettings, group: str) -> None:
        self.settings = settings
        self.group = group
        self._admin: KafkaAdmin | None = None

    @staticmethod
    def client_id(settings: KafkaSettings, node: str) -> str:
        """The client id a node's group consumer uses (EventConsumer names it from the service)."""
        return f"{settings.kafka_client_id}-{service_name(node)}"

    async def live_nodes(self) -> frozenset[str]:
        """Node names of the group's current members."""
        if self._admin is None:
            settings = self.settings
            admin = KafkaAdmin(settings.kafka_bootstrap, client_id=f"{settings.kafka_client_id}-gateway-admin",
                               timeout_s=settings.kafka_request_timeout_ms / 1000)
            await admin.start()  # TransportError if Kafka cannot be reached: asked again next time
            self._admin = admin
        prefix = f"{self.settings.kafka_client_id}-{service_name('')}"
        return frozenset(client_id[len(prefix):] for client_id in await self._admin.group_client_ids(self.group)
                         if client_id.startswith(prefix))

    async def close(self) -> None:
        if self._admin is not None:
            await self._admin.stop()
            self._admin = None


def service_name(node: str) -> str:
    """The service name (and so the Kafka client id suffix) of a node's group consumer."""
    return f"gateway-node.{node}"
