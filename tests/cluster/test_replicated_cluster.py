"""The three-node cluster (deploy/kafka_cluster.py) and what replication promises: the nodes form
one quorum, rollwire's topics get three replicas with two in sync and no unclean election, and events that
the producer (acks=all, idempotent) had acknowledged survive the SIGKILL of the broker leading most of
their partitions, each exactly once, while sends go on through the leader change."""

from __future__ import annotations

import asyncio
import collections
import json
import time

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from deploy.kafka_cluster import KafkaCluster
from schemas.sessions import SessionStage, SessionStageChanged
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaAdmin, KafkaSettings, PublishError

pytestmark = pytest.mark.kafka


async def _topic_configs(bootstrap: str, name: str, timeout_s: float = 30.0) -> dict[str, str]:
    """The topic's configs, as the broker asked answers them. A node whose metadata has not yet caught up
    with the topic's creation answers an error (unknown topic) and no entries; ask again until one knows."""
    deadline = time.monotonic() + timeout_s
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        while True:
            (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name)])
            ((error_code, error_message, _type, _name, entries),) = response.resources
            if error_code == 0:
                return {entry[0]: entry[1] for entry in entries}
            assert time.monotonic() < deadline, f"describe_configs({name}): error {error_code} {error_message}"
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


async def _leading_most(admin: KafkaAdmin, topic: str) -> int:
    leaders = collections.Counter(p.leader for p in await admin.partitions(topic))
    return leaders.most_common(1)[0][0]


def test_layout_is_written_and_found_again(kafka_cluster: KafkaCluster) -> None:
    found = KafkaCluster.load(kafka_cluster.base)
    assert found is not None and found.bootstrap == kafka_cluster.bootstrap
    layout = json.loads(kafka_cluster.layout_file.read_text())
    assert [n["node_id"] for n in layout["nodes"]] == [1, 2, 3]
    ids = {n.config.cluster_id for n in kafka_cluster.nodes}
    assert ids == {layout["cluster_id"]}
    for node in kafka_cluster.nodes:  # every node formatted with the shared id
        assert f"cluster.id={layout['cluster_id']}" in (node.config.data_dir / "meta.properties").read_text()


async def test_three_nodes_form_one_cluster_and_topics_are_replicated(kafka_cluster: KafkaCluster,
                                                                      cluster_kafka: KafkaSettings) -> None:
    async with KafkaAdmin(cluster_kafka.kafka_bootstrap) as admin:
        assert await admin.broker_ids() == [1, 2, 3]
        completions = cluster_kafka.registry().name(Topic.COMPLETIONS)
        partitions = await admin.partitions(completions)
    assert len(partitions) == cluster_kafka.session_partitions
    for state in partitions:
        assert sorted(state.replicas) == [1, 2, 3] and sorted(state.isr) == [1, 2, 3], state
    # Leadership is spread: no node leads everything.
    assert len({state.leader for state in partitions}) > 1
    configs = await _topic_configs(cluster_kafka.kafka_bootstrap, completions)
    assert configs["min.insync.replicas"] == "2"
    assert configs["unclean.leader.election.enable"] == "false"


async def test_acknowledged_events_survive_the_leader_being_killed(restarted: KafkaCluster,
                                                                   cluster_kafka: KafkaSettings) -> None:
    """SIGKILL the broker leading most `session-events` partitions while a producer sends; every event whose
    send returned is in the log exactly once (idempotence: retries after the leader change add no copy);
    the node then restarts and is back in every partition's in-sync replicas."""
    topic = cluster_kafka.registry().name(Topic.SESSION_EVENTS)
    async with KafkaAdmin(cluster_kafka.kafka_bootstrap) as admin:
        victim = await _leading_most(admin, topic)
    acknowledged: list[str] = []
    failed = 0
    killed_at: float | None = None

    async def send_all(producer: EventProducer, count: int) -> None:
        nonlocal failed
        for i in range(count):
            events = [SessionStageChanged(session_id=f"s{i}-{k}", stage=SessionStage.RUNNING) for k in range(6)]
            try:
                await producer.send_many(events)
            except PublishError:
                failed += len(events)
                continue
            acknowledged.extend(e.event_id for e in events)

    async with EventProducer(cluster_kafka, service="failover-test") as producer:
        await send_all(producer, 20)
        killed_at = time.monotonic()
        await asyncio.to_thread(restarted.kill, victim)
        await send_all(producer, 40)  # these go through the leader change
        async with KafkaAdmin(cluster_kafka.kafka_bootstrap) as admin:
            moved = await admin.partitions(topic)
            assert victim not in {state.leader for state in moved}
            assert all(victim not in state.isr for state in moved)
    assert failed == 0  # two replicas in sync remained: nothing had to be refused
    assert killed_at is not None

    await asyncio.to_thread(restarted.restart, victim)
    async with KafkaAdmin(cluster_kafka.kafka_bootstrap) as admin:
        deadline = time.monotonic() + 120
        while True:
            states = await admin.partitions(topic)
            if all(sorted(state.isr) == [1, 2, 3] for state in states):
                break
            assert time.monotonic() < deadline, f"node {victim} did not rejoin the in-sync replicas: {states}"
            await asyncio.sleep(0.5)

    seen: collections.Counter[str] = collections.Counter()
    async with EventConsumer(cluster_kafka, [Topic.SESSION_EVENTS], group_id=None, dedupe_window=0,
                             dead_letters=False) as consumer:
        ends = await consumer.end_offsets(await consumer.wait_for_assignment())
        while not await consumer.caught_up(ends):
            for received in await consumer.getmany(timeout_ms=500):
                seen[received.event.event_id] += 1
    assert len(acknowledged) == 60 * 6
    lost = [event_id for event_id in acknowledged if seen[event_id] == 0]
    doubled = [event_id for event_id, n in seen.items() if n > 1]
    assert lost == [] and doubled == []


async def test_nothing_is_acknowledged_while_two_of_three_are_down(restarted: KafkaCluster,
                                                                  cluster_kafka: KafkaSettings) -> None:
    """With two of three nodes gone (no controller quorum, one replica) no send is acknowledged: a caller
    must give up by its own deadline (aiokafka 0.14 has no delivery timeout: while the partition's leader is
    known but dead it retries forever). The send it gave up on stays in the producer and may land once the
    nodes return, once at most (idempotence); sends made afterwards succeed."""
    async with EventProducer(cluster_kafka, service="isr-test") as producer:
        await producer.send(SessionStageChanged(session_id="before", stage=SessionStage.RUNNING))
        await asyncio.to_thread(restarted.kill, 2)
        await asyncio.to_thread(restarted.kill, 3)
        abandoned = SessionStageChanged(session_id="alone", stage=SessionStage.RUNNING)
        with pytest.raises((PublishError, TimeoutError)):
            await asyncio.wait_for(producer.send(abandoned), 15)
        await asyncio.to_thread(restarted.start, 180)
        after = SessionStageChanged(session_id="after", stage=SessionStage.RUNNING)
        await asyncio.wait_for(producer.send(after), 60)
    seen: collections.Counter[str] = collections.Counter()
    async with EventConsumer(cluster_kafka, [Topic.SESSION_EVENTS], group_id=None, dedupe_window=0,
                             dead_letters=False) as consumer:
        ends = await consumer.end_offsets(await consumer.wait_for_assignment())
        while not await consumer.caught_up(ends):
            for received in await consumer.getmany(timeout_ms=500):
                assert isinstance(received.event, SessionStageChanged)
                seen[received.event.session_id] += 1
    assert seen["before"] == 1 and seen["after"] == 1 and seen["alone"] <= 1, seen
