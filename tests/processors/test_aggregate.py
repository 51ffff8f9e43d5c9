"""The worker's logic without Kafka: SessionAggregator over dict tables, the payload cache, CallRef.

Completion payloads are not copied into tables (a table write re-sends its value to the
changelog); these tests pin what replaces them: the session's one small value holding the log offsets of
its completions, the bytes from the cache, and the log read back by offset when the cache misses (after a
restart), with the same trajectory; and a batch of records costs one table write per session. The
prompt deltas are resolved before the build (the same trajectory as from full events, v1 and v2 mixed),
and a call whose parent is missing is dead-lettered with the calls resting on it, never built.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import orjson

from processors.trajectories.aggregate import Outputs, SessionAggregator, Tables, built_entry
from processors.trajectories.payloads import LogReadError, PayloadCache
from processors.trajectories.progress import InputProgress
from processors.trajectories.open_sessions import CallRef, OpenSession
from processors.trajectories.session_builds import TrajectoryRecord
from processors.trajectories.intake import completion_session
from schemas.codec import HEADER_EVENT_TYPE, HEADER_SCHEMA_VERSION, decode_event, encode_event, event_headers
from schemas.dead_letter import DeadLetter
from schemas.prompt_chain import is_delta, write_session
from schemas.topics import Topic, TopicRegistry
from schemas.trajectories import Trajectory
from tests.processors.worker_process import expected
from tests.processors.worker_process import SessionPlan, linear_session

REGISTRY = TopicRegistry("u.", 4, 2)
CONTROL = "u.processors-control"


@dataclass
class Rec:
    topic: str
    partition: int
    offset: int
    value: bytes | None
    key: bytes | None
    timestamp: float = 0.0
    headers: Any = None


@dataclass
class FakeKafka:
    """Records the aggregator's sends; serves the completions log by offset."""

    log: dict[tuple[int, int], bytes] = field(default_factory=dict)
    trajectories: list[Trajectory] = field(default_factory=list)
    reads: list[tuple[int, list[int]]] = field(default_factory=list)
    ends: dict[str, int] = field(default_factory=dict)  # topic -> high watermark (one partition used)

    def outputs(self) -> Outputs:
        async def send_trajectory(record: TrajectoryRecord, partition: int) -> None:
            trajectory = decode_event(record.value, REGISTRY.spec(Topic.TRAJECTORIES))
            assert isinstance(trajectory, Trajectory)
            assert (trajectory.session_id, trajectory.event_id) == (record.session_id, record.event_id)
            self.trajectories.append(trajectory)

        async def nothing(*args: object) -> None:
            return None

        async def read(partition: int, offsets: list[int]) -> dict[int, bytes]:
            self.reads.append((partition, offsets))
            return {o: self.log[partition, o] for o in offsets if (partition, o) in self.log}

        return Outputs(send_trajectory, nothing, nothing, lambda topic, p: self.ends.get(topic, 0), read)


def _aggregator(tables: Tables, kafka: FakeKafka, **kwargs: Any) -> SessionAggregator:
    return SessionAggregator(tables, kafka.outputs(), REGISTRY, control_topic=CONTROL, group="g", idle_s=600,
                             grace_s=30, settle_s=0, max_message_bytes=8 << 20, **kwargs)


def _records(plan, kafka: FakeKafka, offset_base: int = 0) -> list[Rec]:
    out, offsets = [], {}
    events = [e for e in (plan.spec, *plan.completions, plan.end) if e is not None]
    for ts, event in enumerate(events):
        topic = REGISTRY.name(event.topic)
        offset = offsets.get(topic, offset_base)
        offsets[topic] = offset + 1
        kafka.ends[topic] = max(kafka.ends.get(topic, 0), offset + 1)
        value = encode_event(event)
        if event.topic is Topic.COMPLETIONS:
            kafka.log[1, offset] = value
        out.append(Rec(topic, 1, offset, value, plan.session_id.encode(), timestamp=float(ts)))
    return out


def _tables() -> Tables:
    return Tables(open={}, specs={}, built={})


async def test_tables_hold_small_refs_and_the_build_uses_the_cache() -> None:
    plan = linear_session("a1", turns=4, seed=1)
    kafka, tables = FakeKafka(), _tables()
    aggregator = _aggregator(tables, kafka)
    for record in _records(plan, kafka):
        await aggregator.handle(record)
    assert [t.event_id for t in kafka.trajectories] == [expected(plan).event_id]
    assert kafka.reads == []  # everything came from the cache


async def test_writes_wait_for_the_flush_and_cost_one_per_session() -> None:
    """Two sessions' records interleaved: nothing reaches the table before the flush, then one write per
    session holding its offsets; reads before the flush already see the pending state."""
    plans = [linear_session(f"b{i}", turns=3, seed=20 + i, ended=False) for i in range(2)]
    kafka = FakeKafka()
    streams = [_records(plan, kafka, offset_base=100 * i) for i, plan in enumerate(plans)]
    batch = [record for pair in zip(*streams) for record in pair]
    writes: list[bytes] = []

    class CountingDict(dict):
        def __setitem__(self, key: bytes, value: bytes) -> None:
            writes.append(key)
            super().__setitem__(key, value)

    tables = Tables(open=CountingDict(), specs={}, built={})
    aggregator = _aggregator(tables, kafka)
    for record in batch:  # as the app does: one record at a time, the writes held until the flush
        await aggregator.handle_batch((record,))
    assert writes == [] and OpenSession.loads(aggregator.t.open.get(b"b1")).offsets == (100, 101, 102)
    entered: list[int] = []
    assert aggregator.flush(lambda partition: entered.append(partition) or True) == 4  # 2 specs, 2 sessions
    assert entered == [1]
    assert sorted(writes) == [b"b0", b"b1"]
    for i, sid in enumerate((b"b0", b"b1")):
        raw = tables.open[sid]
        assert len(raw) < 200  # offsets, never payloads
        assert OpenSession.loads(raw).offsets == tuple(100 * i + n for n in range(3))


async def test_a_restart_reads_payloads_back_from_the_log() -> None:
    """After a restart the cache is empty: the same trajectory, its completions read back by offset."""
    plan = linear_session("a2", turns=5, seed=2)
    kafka, tables = FakeKafka(), _tables()
    records = _records(plan, kafka)
    first = _aggregator(tables, kafka)
    for record in records[:-1]:  # spec and completions, then the worker dies
        await first.handle(record)
    restarted = _aggregator(tables, kafka)  # same (changelogged) tables, fresh memory
    restarted.progress.active_since = 0.0  # the timer's first tick: settled (settle_s is 0)
    await restarted.handle(records[-1])
    await restarted.handle(records[2])  # a re-delivered completion: same offset, used once
    assert [t.event_id for t in kafka.trajectories] == [expected(plan).event_id]
    assert kafka.reads == [(1, [0, 1, 2, 3, 4])]
    assert restarted.counters["read_back"] == 5 and restarted.counters["lost"] == 0


async def test_an_evicted_payload_gone_from_the_log_is_counted_lost() -> None:
    plan = linear_session("a3", turns=3, seed=3)
    kafka, tables = FakeKafka(), _tables()
    aggregator = _aggregator(tables, kafka, cache_bytes=0)  # nothing fits: every payload read back
    records = _records(plan, kafka)
    del kafka.log[1, 0]  # deleted by retention before the session was built
    for record in records:
        await aggregator.handle(record)
    assert aggregator.counters["lost"] == 1 and aggregator.counters["read_back"] == 2
    assert kafka.trajectories[0].stats.completions == 2


async def test_a_call_not_readable_back_now_defers_the_build_and_never_leaves_the_call_out() -> None:
    """While a broker fails, a read-back can come back short: the partition's leader away, or a fetch slower
    than the reader's timeout (LogReader raises LogReadError then). The worker that took the session over must not build it
    without them, as if they were gone: that trajectory would miss the calls and have another event id than
    the one the session's first worker sent. It waits; the timer asks again, and the build is the same."""
    plan = linear_session("a4", turns=4, seed=4)
    kafka, tables = FakeKafka(), _tables()
    records = _records(plan, kafka)
    first = _aggregator(tables, kafka)
    for record in records[:-1]:
        await first.handle(record)
    unreadable = [True]
    outputs = kafka.outputs()
    read_from_log = outputs.read_completions

    async def read(partition: int, offsets: list[int]) -> dict[int, bytes]:
        if unreadable[0]:
            raise LogReadError(f"offsets {offsets} of completions[{partition}] could not be read within 30 s")
        return await read_from_log(partition, offsets)

    controls: list[tuple[str, dict[str, Any]]] = []

    async def send_control(session_id: str, partition: int, record: dict[str, Any]) -> None:
        controls.append((session_id, record))

    outputs.read_completions, outputs.send_control = read, send_control
    clock = [100.0]
    taken_over = SessionAggregator(tables, outputs, REGISTRY, control_topic=CONTROL, group="g", idle_s=600,
                                   grace_s=30, settle_s=0, max_message_bytes=8 << 20, clock=lambda: clock[0])
    taken_over.progress.active_since = 0.0
    await taken_over.handle(records[-1])
    assert kafka.trajectories == [] and taken_over.counters["builds_deferred"] == 1
    assert taken_over.counters["lost"] == 0 and "a4" not in taken_over.in_flight
    unreadable[0] = False  # the new leader has caught up
    clock[0] += 5.0
    await taken_over.tick({1})
    assert controls == [("a4", {"kind": "finalize", "session_id": "a4"})]
    await taken_over.handle(Rec(CONTROL, 1, 0, orjson.dumps(controls[0][1]), b"a4"))
    assert [t.event_id for t in kafka.trajectories] == [expected(plan).event_id]
    assert kafka.trajectories[0].stats.completions == 4 and taken_over.counters["lost"] == 0


def test_payload_cache_evicts_oldest_and_retains_assigned_partitions() -> None:
    cache = PayloadCache(max_bytes=10)
    cache.put(0, 1, b"aaaa")
    cache.put(1, 1, b"bbbb")
    cache.put(0, 2, b"cccc")  # over budget: (0, 1) goes
    assert cache.get(0, 1) is None and cache.get(1, 1) == b"bbbb" and cache.bytes == 8
    cache.retain({0})
    assert cache.get(1, 1) is None and cache.get(0, 2) == b"cccc" and cache.bytes == 4
    cache.discard(0, 2)
    assert len(cache) == 0 and cache.bytes == 0


def test_call_ref_round_trip() -> None:
    assert CallRef.loads(CallRef(7, 123456789).dumps()) == CallRef(7, 123456789)


async def test_ended_sessions_wait_for_their_partition_in_end_order() -> None:
    """An ended session is built once its partition is handled up to where the broker said it ended
    after the end was handled (oldest end first); another session's records stamped after the end, but
    by less than the clocks may disagree, do not count."""
    plans = [linear_session(f"w{i}", turns=2, seed=10 + i) for i in range(2)]
    kafka, tables = FakeKafka(), _tables()
    completions = REGISTRY.name(Topic.COMPLETIONS)
    broker: dict[str, int] = {}

    async def log_ends(partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        return {(topic, p): broker.get(topic, 0) for topic, p in partitions}

    outputs = kafka.outputs()
    outputs.log_ends = log_ends
    clock = [100.0]
    aggregator = SessionAggregator(tables, outputs, REGISTRY, control_topic=CONTROL, group="g", idle_s=600,
                                   grace_s=30, settle_s=0, max_message_bytes=8 << 20, clock=lambda: clock[0])
    streams = [_records(plan, FakeKafka()) for plan in plans]
    # The completions partition: w0's first call @0, w1's @1, another session's calls @2-3, then the last
    # calls of w0 @4 and w1 @5. The ends are handled when only @0-1 are.
    firsts, lasts = [stream[1] for stream in streams], [stream[2] for stream in streams]
    for offset, record in enumerate([*firsts, None, None, *lasts]):
        if record is not None:
            assert record.topic == completions
            record.offset = offset
            kafka.log[1, offset] = record.value  # type: ignore[index]
    for i, stream in enumerate(streams):
        stream[0].offset = i  # the specs
        await aggregator.handle(stream[0])
    for record in firsts:
        await aggregator.handle(record)
    broker.update({completions: 6, REGISTRY.name(Topic.SESSIONS): 2})
    for i, stream in enumerate(streams):
        clock[0] += 1.0
        stream[-1].offset = i  # the ends, on the session events topic
        await aggregator.handle(stream[-1])
    assert kafka.trajectories == [] and aggregator.ends_wanted == {1}
    assert await aggregator.ask_wanted_ends({1}) == set()  # the broker's end is past both last calls
    other = linear_session("w2", turns=2, seed=12, ended=False).completions
    for offset, call in enumerate(other, start=2):  # stamped later, but within the clock skew: no help
        kafka.log[1, offset] = encode_event(call)
        await aggregator.handle(Rec(completions, 1, offset, kafka.log[1, offset], b"w2", timestamp=3.04))
        assert kafka.trajectories == []
    await aggregator.handle(lasts[0])
    assert kafka.trajectories == []  # w0's call is in, but the end asked after w0's end is past w1's call
    await aggregator.handle(lasts[1])
    assert [t.session_id for t in kafka.trajectories] == ["w0", "w1"]
    assert [_traces(t) for t in kafka.trajectories] == [_traces(expected(plan)) for plan in plans]


async def test_open_sessions_are_read_from_the_table_once_per_assignment() -> None:
    """The open table is iterated once per assignment; the agent's writes keep the copy in memory
    current, so neither records nor the timer's scans read it again; a restart reads it back."""
    plan = linear_session("t1", turns=2, seed=5, ended=False)
    kafka = FakeKafka()
    scans: list[int] = []

    class ScannedDict(dict):
        def items(self):
            scans.append(1)
            return super().items()

    tables = Tables(open=ScannedDict(), specs={}, built={})
    clock = [1000.0]
    aggregator = _aggregator(tables, kafka, clock=lambda: clock[0])
    sent: list[dict] = []

    async def send_control(session_id: str, partition: int, record: dict) -> None:
        sent.append(record)

    aggregator.out.send_control = send_control
    await aggregator.tick({1})  # nothing open yet
    for record in _records(plan, kafka)[:-1]:
        await aggregator.handle(record)
    clock[0] += 10_000  # past the idle deadline
    await aggregator.tick({1})
    assert scans == [1] and sent == [{"kind": "deadline", "session_id": "t1"}]
    restarted = _aggregator(tables, kafka, clock=lambda: clock[0])
    restarted.out.send_control = send_control
    restarted.progress.active_since = 0.0
    await restarted.tick({1})
    assert scans == [1, 1] and len(sent) == 2  # the restarted worker found the session in the table


async def test_a_flush_drops_writes_of_partitions_no_longer_ours() -> None:
    plan = linear_session("d1", turns=2, seed=30, ended=False)
    kafka, tables = FakeKafka(), _tables()
    aggregator = _aggregator(tables, kafka)
    for record in _records(plan, kafka):
        await aggregator.handle_batch((record,))
    assert aggregator.flush(lambda partition: False) == 0
    assert tables.open == {} and tables.specs == {} and aggregator.t.open.get(b"d1") is None


def test_a_partition_ending_in_transaction_markers_counts_as_drained_once_they_are_read_back() -> None:
    """A transactional producer's commit marker takes an offset no consumer sees: the last record read is
    one short of the partition's end. However long it stays quiet (a record held back by a paused
    partition is quiet too), that gap counts as drained only once the worker read it back from the log
    and found no record there."""
    progress = InputProgress(settle_s=1.0)
    progress.saw("c", 0, 41, timestamp=5.0)
    highwater = {("c", 0): 43}
    ends = lambda topic, partition: highwater[topic, partition]  # noqa: E731
    assert not progress.read_up_to(["c"], 0, ts=9.0, now=500.0, end_of=ends)
    progress.accounted("c", 0, 42)
    assert progress.read_up_to(["c"], 0, ts=9.0, now=500.0, end_of=ends)
    progress.accounted("c", 0, 30)  # an older read-back moves nothing back
    assert progress.read_up_to(["c"], 0, ts=9.0, now=500.0, end_of=ends)


def test_a_record_stamped_later_than_the_end_by_more_than_the_clock_skew_is_past_it() -> None:
    """Record timestamps come from the producers' clocks: a record stamped after the end, by less than
    the clocks may disagree (or in the same millisecond), may have been written before the session's
    last call. Past the margin it was written after the end, so after the session's calls."""
    progress = InputProgress(settle_s=1.0, clock_skew_s=0.5)
    nothing = lambda topic, partition: None  # noqa: E731  (no end asked)
    progress.saw("c", 0, 10, timestamp=9.0)
    assert not progress.read_up_to(["c"], 0, ts=9.0, now=100.0, end_of=nothing)
    progress.saw("c", 0, 11, timestamp=9.5)
    assert not progress.read_up_to(["c"], 0, ts=9.0, now=100.0, end_of=nothing)
    progress.saw("c", 0, 12, timestamp=9.501)
    assert progress.read_up_to(["c"], 0, ts=9.0, now=100.0, end_of=nothing)
    assert not progress.read_up_to(["c", "d"], 0, ts=9.0, now=100.0, end_of=nothing)  # every input


def test_a_session_uses_the_first_end_asked_after_its_end_was_handled() -> None:
    """An end asked before the session's end was handled may not hold its last call; the newest end
    asked would keep a worker that is behind its producers waiting for ever. The first one asked since
    counts."""
    progress = InputProgress(settle_s=1.0)
    progress.asked_ends({("c", 0): 12}, asked_at=5.0)
    assert progress.log_end("c", 0, since=6.0) is None  # asked before: may not hold what came before the end
    assert progress.log_end("c", 0, since=5.0) == 12
    progress.asked_ends({("c", 0): 40}, asked_at=7.0)
    progress.asked_ends({("c", 0): 90}, asked_at=9.0)
    progress.asked_ends({("c", 0): 60}, asked_at=8.0)  # answered after a later request: not kept
    assert [progress.log_end("c", 0, since=t) for t in (1.0, 5.0, 5.5, 7.0, 8.5, 9.0, 9.5)] == \
        [12, 12, 40, 40, 90, 90, None]
    assert progress.log_end("c", 1, since=0.0) is None  # never asked
    progress.saw("c", 0, 39, timestamp=1.0)
    assert progress.read_up_to(["c"], 0, ts=9.0, now=0.0, end_of=lambda t, p: progress.log_end(t, p, 6.0))
    assert not progress.read_up_to(["c"], 0, ts=9.0, now=0.0, end_of=lambda t, p: progress.log_end(t, p, 8.0))
    progress.reset()
    assert progress.log_end("c", 0, since=0.0) is None


async def test_a_stale_high_watermark_does_not_build_a_session_without_its_last_call() -> None:
    """The consumer's high watermark is only as fresh as its last fetch of a partition: here it says the
    completions are drained while the session's last call (acknowledged before its end was sent) is on
    the log and not handed out yet. The session waits for an end asked from the broker after its end
    was handled, and is built with every call once that call is in."""
    plan = linear_session("s1", turns=3, seed=31)
    kafka, tables = FakeKafka(), _tables()
    records = _records(plan, kafka)
    completions = REGISTRY.name(Topic.COMPLETIONS)
    last_call = max((r for r in records if r.topic == completions), key=lambda r: r.offset)
    broker_ends = dict(kafka.ends)  # the log as the broker has it: every record on it
    kafka.ends[completions] = last_call.offset  # the consumer's last fetch: before the last call
    asked: list[list[tuple[str, int]]] = []

    async def log_ends(partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        asked.append(partitions)
        return {(topic, p): broker_ends.get(topic, 0) for topic, p in partitions}

    controls: list[dict[str, Any]] = []

    async def send_control(session_id: str, partition: int, record: dict[str, Any]) -> None:
        controls.append(record)

    outputs = kafka.outputs()
    outputs.log_ends, outputs.send_control = log_ends, send_control
    clock = [100.0]
    aggregator = SessionAggregator(tables, outputs, REGISTRY, control_topic=CONTROL, group="g", idle_s=600,
                                   grace_s=30, settle_s=0, max_message_bytes=8 << 20, clock=lambda: clock[0])
    for record in records:
        if record is not last_call:
            await aggregator.handle(record)
    assert kafka.trajectories == []  # the high watermark says drained; no end asked since the end: wait
    assert aggregator.ends_wanted == {1} and aggregator.ends_needed.is_set()
    assert await aggregator.ask_wanted_ends({1}) == set() and len(asked) == 1  # asked; not ready: no recheck
    await aggregator.handle(Rec(CONTROL, 1, 0, b'{"kind": "recheck", "session_id": ""}', b""))
    assert kafka.trajectories == []  # the broker's end lies past the last call handled: not ready
    assert aggregator.ends_wanted == set()  # an end was asked since: the stream's records move it on
    clock[0] += 0.5
    await aggregator.tick({1})
    assert len(asked) == 2 and controls == []  # the timer asks too, and finds it not ready either
    await aggregator.handle(last_call)
    assert [_traces(t) for t in kafka.trajectories] == [_traces(expected(plan))]


async def test_the_last_session_of_a_quiet_partition_is_built_without_waiting_for_the_timer() -> None:
    """Its end is the partition's last record, so no later record passes it: the broker's ends are asked
    at once, and the "recheck" control record that follows builds it."""
    plan = linear_session("q1", turns=2, seed=33)
    kafka, tables = FakeKafka(), _tables()
    records = _records(plan, kafka)

    async def log_ends(partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        return {(topic, p): kafka.ends.get(topic, 0) for topic, p in partitions}

    outputs = kafka.outputs()
    outputs.log_ends = log_ends
    aggregator = SessionAggregator(tables, outputs, REGISTRY, control_topic=CONTROL, group="g", idle_s=600,
                                   grace_s=30, settle_s=0, max_message_bytes=8 << 20)
    for record in records:
        await aggregator.handle(record)
    assert kafka.trajectories == [] and aggregator.ends_wanted == {1}
    assert await aggregator.ask_wanted_ends({0, 2}) == set()  # not ours any more: not asked
    aggregator.ends_wanted.add(1)
    assert await aggregator.ask_wanted_ends({1}) == {1}
    await aggregator.handle(Rec(CONTROL, 1, 0, b'{"kind": "recheck", "session_id": ""}', b""))
    assert [_traces(t) for t in kafka.trajectories] == [_traces(expected(plan))]


async def test_completions_vouched_for_by_their_headers_are_checked_in_full_at_the_build() -> None:
    """A completion whose headers name the event type and a schema version this worker reads is taken by
    its key without parsing its value; its full validation at the build still catches a record whose
    value is not JSON or belongs to another session (dead-lettered then, the trajectory built without
    it). Records without those headers are checked at the door, as before."""
    plan = linear_session("h1", turns=3, seed=41)
    kafka, tables = FakeKafka(), _tables()
    letters: list[DeadLetter] = []

    async def send_dead_letter(letter: DeadLetter) -> None:
        letters.append(letter)

    outputs = kafka.outputs()
    outputs.send_dead_letter = send_dead_letter
    aggregator = SessionAggregator(tables, outputs, REGISTRY, control_topic=CONTROL, group="g", idle_s=600,
                                   grace_s=30, settle_s=0, max_message_bytes=8 << 20)
    records = _records(plan, kafka)
    completions = REGISTRY.name(Topic.COMPLETIONS)
    vouched = event_headers(plan.completions[0])
    for record in records:
        if record.topic == completions:
            record.headers = vouched
    other = linear_session("h2", turns=1, seed=42).completions[0]
    lying = [Rec(completions, 1, 50, b"{not json", b"h1", headers=vouched),
             Rec(completions, 1, 51, encode_event(other), b"h1", headers=vouched)]
    unvouched = Rec(completions, 1, 52, b"{not json either", b"h1")  # no headers: checked at the door
    for record in lying:
        kafka.log[1, record.offset] = record.value  # type: ignore[index]
    for record in [*records[:2], *lying, unvouched, *records[2:]]:
        await aggregator.handle(record)
    assert [(letter.offset, letter.error_type) for letter in letters] == \
        [(52, "invalid_json"), (50, "invalid_json"), (51, "key_mismatch")]
    assert [_traces(t) for t in kafka.trajectories] == [_traces(expected(plan))]


def test_completion_session_needs_the_completion_headers_and_a_key() -> None:
    call = linear_session("k1", turns=1, seed=43).completions[0]
    headers = event_headers(call)
    assert completion_session(b"{}", b"k1", headers) == "k1"
    assert completion_session(b"{}", b"k1", dict(headers)) == "k1"
    assert completion_session(b"{}", None, headers) is None
    assert completion_session(None, b"k1", headers) is None
    assert completion_session(b"{}", b"\xff", headers) is None  # not UTF-8: peek says what is wrong
    assert completion_session(b"{}", b"k1", None) is None
    wrong_version = [(name, b"99" if name == HEADER_SCHEMA_VERSION else value) for name, value in headers]
    assert completion_session(b"{}", b"k1", wrong_version) is None
    other_type = [(name, b"session.ended" if name == HEADER_EVENT_TYPE else value) for name, value in headers]
    assert completion_session(b"{}", b"k1", other_type) is None


# -- prompt deltas ----------------------------------------------------------------------------

def _delta_plan(plan: SessionPlan) -> SessionPlan:
    """The session as the proxy writes it now: the first call a keyframe, each later one a delta."""
    written = write_session(plan.completions)
    assert not is_delta(written[0]) and all(is_delta(c) for c in written[1:])
    return SessionPlan(plan.spec, written, plan.end)


def _traces(trajectory: Trajectory) -> list[dict]:
    return [t.model_dump(mode="json") for t in trajectory.traces]


async def test_delta_sessions_build_what_full_ones_build() -> None:
    """Deltas resolved in the worker give the trajectory of the full events (id, traces, stats), from the
    cache and from the log read back alike; a v1 keyframe followed by v2 deltas (a log spanning the
    upgrade) too."""
    plan = linear_session("d2", turns=5, seed=41)
    delta = _delta_plan(plan)
    first = delta.completions[0]
    mixed = SessionPlan(plan.spec, [first.model_copy(update={"schema_version": 1}), *delta.completions[1:]], plan.end)
    want = expected(plan)
    for sent, cache_bytes in ((delta, 512 << 20), (delta, 0), (mixed, 512 << 20)):
        kafka = FakeKafka()
        aggregator = _aggregator(_tables(), kafka, cache_bytes=cache_bytes)
        for record in _records(sent, kafka):
            await aggregator.handle(record)
        (got,) = kafka.trajectories
        assert got.event_id == want.event_id and _traces(got) == _traces(want) and got.stats == want.stats
        assert aggregator.counters["unresolved"] == 0 and aggregator.counters["dead_lettered"] == 0


async def test_a_delta_whose_parent_is_gone_is_dead_lettered_never_built() -> None:
    """The second call is gone from the log (retention): it and the calls whose prompts rest on it are
    dead-lettered as missing_prompt_parent and left out; the trajectory holds the first call only, exactly
    as built from it alone, and names the left-out calls in its problems."""
    plan = linear_session("d3", turns=4, seed=42)
    kafka, letters = FakeKafka(), []
    aggregator = _aggregator(_tables(), kafka, cache_bytes=0)  # every payload read back from the log

    async def send_dead_letter(letter: DeadLetter) -> None:
        letters.append(letter)

    aggregator.out.send_dead_letter = send_dead_letter
    records = _records(_delta_plan(plan), kafka)
    del kafka.log[1, 1]
    for record in records:
        await aggregator.handle(record)
    (got,) = kafka.trajectories
    alone = expected(SessionPlan(plan.spec, plan.completions[:1], plan.end))
    assert got.event_id == alone.event_id and _traces(got) == _traces(alone)
    assert [(d.offset, d.error_type) for d in letters] == [(2, "missing_prompt_parent"), (3, "missing_prompt_parent")]
    assert plan.completions[1].event_id in letters[0].reason
    left_out = [p for p in got.stats.problems if "left out" in p]
    assert len(left_out) == 2 and plan.completions[2].event_id in left_out[0]
    assert aggregator.counters["lost"] == 1 and aggregator.counters["unresolved"] == 2


async def test_a_corrupted_delta_is_dead_lettered_with_its_children() -> None:
    """A delta naming a parent the session never had (a corrupted reference) breaks its chain from there."""
    plan = linear_session("d4", turns=4, seed=43)
    delta = _delta_plan(plan)
    broken = delta.completions[2]
    assert broken.prompt_delta is not None
    delta.completions[2] = broken.model_copy(update={
        "prompt_delta": broken.prompt_delta.model_copy(update={"parent_event_id": "no-such-event"})})
    kafka, letters = FakeKafka(), []
    aggregator = _aggregator(_tables(), kafka)

    async def send_dead_letter(letter: DeadLetter) -> None:
        letters.append(letter)

    aggregator.out.send_dead_letter = send_dead_letter
    for record in _records(delta, kafka):
        await aggregator.handle(record)
    (got,) = kafka.trajectories
    alone = expected(SessionPlan(plan.spec, plan.completions[:2], plan.end))
    assert got.event_id == alone.event_id and _traces(got) == _traces(alone)
    assert [d.offset for d in letters] == [2, 3] and {d.error_type for d in letters} == {"missing_prompt_parent"}
    assert "no-such-event" in letters[0].reason and "no-such-event" in letters[1].reason


async def test_a_recorded_trajectory_is_forgotten_before_the_next_record_and_its_replays_are_late() -> None:
    """The broker's acknowledgement of a trajectory reaches the aggregator as a call (no control record
    through the broker): the session stays in flight until the agent's next record, which first drops
    its entries and keeps its event id in ``built``; a replayed call of it is then late, never rebuilt."""
    plan, other = linear_session("r1", turns=3, seed=40), linear_session("r2", turns=2, seed=41, ended=False)
    kafka, tables = FakeKafka(), _tables()
    aggregator = _aggregator(tables, kafka)
    records = _records(plan, kafka)
    for record in records:
        await aggregator.handle(record)
    (trajectory,) = kafka.trajectories
    aggregator.trajectory_recorded("r1", 1, trajectory.event_id)
    assert "r1" in aggregator.in_flight and b"r1" in tables.open  # not applied by the callback itself
    await aggregator.handle(_records(other, kafka, offset_base=50)[0])
    assert "r1" not in aggregator.in_flight and b"r1" not in tables.open and b"r1" not in tables.specs
    assert built_entry(tables.built[b"r1"]) == (trajectory.event_id, 2)  # and its last call's offset
    await aggregator.handle(records[2])  # a replayed completion of the built session
    assert aggregator.counters["late"] == 1 and len(kafka.trajectories) == 1


async def test_the_timer_forgets_recorded_trajectories_only_between_records() -> None:
    """A quiet partition has no next record: the timer's tick forgets the session, but never while the
    agent is in the middle of a record (whose state it could write back after the deletion)."""
    plan = linear_session("r3", turns=2, seed=42)
    kafka, tables = FakeKafka(), _tables()
    aggregator = _aggregator(tables, kafka)
    seen_mid_record: list[bool] = []
    outputs = kafka.outputs()
    sent = outputs.send_trajectory

    async def send_and_ack(record: TrajectoryRecord, partition: int) -> None:
        await sent(record, partition)
        aggregator.trajectory_recorded(record.session_id, partition, record.event_id)
        await aggregator.tick({1})  # the timer runs while the agent awaits this send
        seen_mid_record.append(b"r3" in aggregator._sessions())

    aggregator.out.send_trajectory = send_and_ack
    for record in _records(plan, kafka):
        await aggregator.handle(record)
    assert seen_mid_record == [True] and "r3" in aggregator.in_flight
    await aggregator.tick({1})
    aggregator.flush(lambda partition: True)
    assert "r3" not in aggregator.in_flight and b"r3" not in tables.open
    assert built_entry(tables.built[b"r3"])[0] == kafka.trajectories[0].event_id


async def test_malformed_control_records_are_ignored_and_the_session_still_builds() -> None:
    """The control topic takes records from anyone who can write to it: none of these shapes may stop the
    agent (a session id that is a number raised inside it), and the session is built all the same."""
    plan = linear_session("c1", turns=2, seed=35)
    kafka, tables = FakeKafka(), _tables()
    aggregator = _aggregator(tables, kafka)
    records = _records(plan, kafka)
    for record in records[:-1]:
        await aggregator.handle(record)
    for i, value in enumerate([b'{"kind": "finalize", "session_id": 5}', b'{"kind": ["x"], "session_id": "c1"}',
                               b'[1, 2]', b'"finalize"', b'{"kind": "finalize"}', b"\xff", b"", None]):
        await aggregator.handle(Rec(CONTROL, 1, 100 + i, value, b"c1"))
    assert kafka.trajectories == []
    await aggregator.handle(records[-1])  # the end: built
    assert [_traces(t) for t in kafka.trajectories] == [_traces(expected(plan))]


async def test_a_quiet_session_with_a_spec_waits_for_its_timeout_not_the_idle_deadline() -> None:
    """A harness quiet for longer than idle_s (a quarter-hour test run) keeps its session open until the
    spec's timeout plus the grace: built at the idle deadline, every call it made afterwards was dropped
    as late. A session with no spec is still built once idle for idle_s."""
    clock = [1000.0]
    kafka, tables = FakeKafka(), _tables()
    aggregator = _aggregator(tables, kafka, clock=lambda: clock[0])
    aggregator.progress.active_since = 0.0
    sent: list[dict] = []

    async def send_control(session_id: str, partition: int, record: dict) -> None:
        sent.append(record)

    aggregator.out.send_control = send_control
    with_spec = linear_session("quiet", turns=3, seed=41, ended=False)  # spec timeout_s 1800, idle_s 600
    records = _records(with_spec, kafka)
    no_spec = _records(linear_session("bare", turns=1, seed=42, ended=False), kafka, 100)[1:]  # its call, no spec
    for record in [*records[:2], *no_spec]:  # the spec and the first call; the bare session's call
        await aggregator.handle(record)
    clock[0] += 900  # quiet for 15 minutes: past idle_s, within the spec's timeout
    await aggregator.tick({1})
    assert sent == [{"kind": "deadline", "session_id": "bare"}]
    await aggregator.handle(Rec(CONTROL, 1, 199, b'{"kind": "deadline", "session_id": "bare"}', b"bare"))
    assert [t.partial for t in kafka.trajectories if t.session_id == "bare"] == [True]
    aggregator.trajectory_recorded("bare", 1, kafka.trajectories[0].event_id)
    for record in records[2:]:  # the calls after the quiet spell are the session's, not late
        await aggregator.handle(record)
    assert aggregator.counters["late"] == 0
    clock[0] += 1800 + 30 - 900 + 1  # past first seen + timeout_s + grace_s
    await aggregator.tick({1})
    assert sent[1:] == [{"kind": "deadline", "session_id": "quiet"}]
    await aggregator.handle(Rec(CONTROL, 1, 200, b'{"kind": "deadline", "session_id": "quiet"}', b"quiet"))
    [trajectory] = [t for t in kafka.trajectories if t.session_id == "quiet"]
    assert trajectory.partial and [_traces(trajectory)] == [_traces(expected(with_spec))]


def _idle_aggregator(kafka: FakeKafka, tables: Tables, clock: list[float]) -> tuple[SessionAggregator, list[DeadLetter]]:
    """An aggregator on a clock the test moves, its dead letters kept."""
    aggregator = _aggregator(tables, kafka, clock=lambda: clock[0])
    aggregator.progress.active_since = 0.0
    letters: list[DeadLetter] = []

    async def send_dead_letter(letter: DeadLetter) -> None:
        letters.append(letter)

    async def send_control(session_id: str, partition: int, record: dict) -> None:
        pass

    aggregator.out.send_dead_letter = send_dead_letter
    aggregator.out.send_control = send_control
    return aggregator, letters


async def _build_at_idle_deadline(aggregator: SessionAggregator, clock: list[float], session_id: str) -> None:
    clock[0] += 601  # idle for longer than idle_s: due
    await aggregator.tick({1})
    await aggregator.handle(Rec(CONTROL, 1, 900, orjson.dumps({"kind": "deadline", "session_id": session_id}),
                                session_id.encode()))


async def test_a_call_after_a_session_was_built_is_dead_lettered_and_its_replays_stay_late() -> None:
    """A session with no spec is built at its idle deadline; when its harness comes back, the calls it makes
    are in no trajectory online. They are dead-lettered as ``late_call`` with the reason (a rebuild from the
    log builds the session whole), never dropped unseen; a replayed call the trajectory holds stays late."""
    clock = [1000.0]
    kafka, tables = FakeKafka(), _tables()
    aggregator, letters = _idle_aggregator(kafka, tables, clock)
    calls = _records(linear_session("back", turns=4, seed=43, ended=False), kafka)[1:]  # no spec
    for record in calls[:2]:
        await aggregator.handle(record)
    await _build_at_idle_deadline(aggregator, clock, "back")
    (trajectory,) = kafka.trajectories
    assert trajectory.partial and trajectory.stats.completions == 2
    aggregator.trajectory_recorded("back", 1, trajectory.event_id)
    for record in (calls[2], calls[0], calls[3]):  # a new call, a replay of a built one, a new call
        await aggregator.handle(record)
    assert [(letter.offset, letter.error_type) for letter in letters] == [(2, "late_call"), (3, "late_call")]
    assert trajectory.event_id in letters[0].reason and "rollwire rebuild" in letters[0].reason
    assert base64.b64decode(letters[0].payload) == calls[2].value  # the call itself, as recorded
    assert aggregator.counters["late"] == 1 and aggregator.counters["late_calls"] == 2
    assert len(kafka.trajectories) == 1 and b"back" not in tables.open


async def test_a_call_taken_while_its_session_was_being_built_is_dead_lettered_once_that_is_recorded() -> None:
    """A call that arrives between a session's build and the broker's ack of its trajectory is held by the
    session but is not in the trajectory: when the session is forgotten, it is dead-lettered."""
    clock = [1000.0]
    kafka, tables = FakeKafka(), _tables()
    aggregator, letters = _idle_aggregator(kafka, tables, clock)
    calls = _records(linear_session("busy", turns=3, seed=44, ended=False), kafka)[1:]
    other = _records(linear_session("other", turns=1, seed=45, ended=False), kafka, offset_base=50)[1:]
    for record in calls[:2]:
        await aggregator.handle(record)
    await _build_at_idle_deadline(aggregator, clock, "busy")
    (trajectory,) = kafka.trajectories
    await aggregator.handle(calls[2])  # in flight: taken by the session, not in its trajectory
    assert aggregator.counters["calls_after_build"] == 1 and letters == []
    aggregator.trajectory_recorded("busy", 1, trajectory.event_id)
    await aggregator.handle(other[0])  # the agent's next record: the session is forgotten first
    assert [(letter.offset, letter.error_type) for letter in letters] == [(2, "late_call")]
    assert base64.b64decode(letters[0].payload) == calls[2].value
    assert built_entry(tables.built[b"busy"]) == (trajectory.event_id, 1)
    await aggregator.handle(calls[2])  # replayed after a restart: dead-lettered again, never built
    assert [letter.offset for letter in letters] == [2, 2] and len(kafka.trajectories) == 1
