"""Call numbers on the real broker, two processes claiming for one session: every number once, in the
log's order, each process knowing which numbers were its own and which the other's, and an SDK retry
numbered as the retry of the call it repeats."""

from __future__ import annotations

import asyncio

import pytest

from proxy.capture import Recorder
from proxy.tier.claims import CallNumbers
from schemas.transport import KafkaSettings

pytestmark = pytest.mark.kafka


async def test_two_processes_number_one_session_from_the_log(kafka: KafkaSettings) -> None:
    recorders = [Recorder(kafka, 30), Recorder(kafka, 30)]
    for recorder in recorders:
        await recorder.start()
    a, b = (CallNumbers(kafka, recorder, f"proxy-{i}", 30) for i, recorder in enumerate(recorders))
    a.start()
    b.start()
    try:
        first = await a.claim("s-1", "d0", 0)
        second = await a.claim("s-1", "d1", 0)
        assert (first.sequence, second.sequence, second.offset) == (0, 1, first.offset + 1)
        retry = await a.claim("s-1", "d1", 1)  # an SDK retry of the second call
        assert (retry.sequence, retry.retry_of) == (2, 1)

        foreign = await b.claim("s-1", "d3", 0)  # the other process, from the log: after all three
        assert foreign.sequence == 3
        after = await a.claim("s-1", "d4", 0)  # a claim of the other process before it: counted first
        assert after.sequence == 4

        # Many at once on both: every number once, each process's reader agreeing with the claims.
        claimed = await asyncio.gather(*((a, b)[i % 2].claim("s-1", f"c{i}", 0) for i in range(24)))
        assert sorted(n.sequence for n in claimed) == list(range(5, 29))
        for numbers in (a, b):
            async with asyncio.timeout(30):
                while numbers.calls("s-1") < 29:
                    await asyncio.sleep(0.02)
        assert a.of("s-1").own | b.of("s-1").own == set(range(29))
        assert not a.of("s-1").own & b.of("s-1").own
        assert set(a.of("s-1").foreign) == b.of("s-1").own and set(b.of("s-1").foreign) == a.of("s-1").own
    finally:
        for numbers in (a, b):
            await numbers.stop()
        for recorder in recorders:
            await recorder.stop()
