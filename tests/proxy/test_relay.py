"""The stream's response: the closing chunk goes out with the end of the body, in one message,
and what the stream does after it (the session's bookkeeping) still runs, after the client has it; a
stream whose chunks are always ready still leaves the event loop to everything else."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from proxy.relay import ClosingChunk, RelayResponse


async def sent_by(first: bytes | None, rest: AsyncIterator[bytes]) -> list[dict[str, Any]]:
    """The ASGI messages a RelayResponse sends for ``first`` and ``rest`` (a client that never hangs up)."""
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # never a disconnect
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST"}
    await RelayResponse(first, rest, media_type="text/event-stream")(scope, receive, send)
    return messages


def bodies(messages: list[dict[str, Any]]) -> list[tuple[bytes, bool]]:
    return [(m["body"], m["more_body"]) for m in messages if m["type"] == "http.response.body"]


def test_the_closing_chunk_ends_the_body_and_the_stream_runs_on() -> None:
    seen: list[str] = []

    async def stream() -> AsyncIterator[bytes]:
        yield b"data: 2\n\n"
        try:
            yield ClosingChunk(b"data: [DONE]\n\n")
        finally:
            seen.append("bookkeeping")
        yield b"never sent"

    messages = asyncio.run(sent_by(b"data: 1\n\n", stream()))
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    assert bodies(messages) == [(b"data: 1\n\n", True), (b"data: 2\n\n", True), (b"data: [DONE]\n\n", False)]
    assert seen == ["bookkeeping"]


def test_a_stream_without_a_closing_chunk_ends_when_it_ends() -> None:
    async def stream() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    assert bodies(asyncio.run(sent_by(None, stream()))) == [(b"a", True), (b"b", True), (b"", False)]


def test_a_first_chunk_that_closes_ends_the_body_and_the_rest_still_runs() -> None:
    seen: list[str] = []

    async def rest() -> AsyncIterator[bytes]:
        seen.append("bookkeeping")
        yield b"never sent"

    messages = asyncio.run(sent_by(ClosingChunk(b"data: [DONE]\n\n"), rest()))
    assert bodies(messages) == [(b"data: [DONE]\n\n", False)]
    assert seen == ["bookkeeping"]


def test_a_stream_whose_chunks_are_always_ready_leaves_the_loop_to_the_rest() -> None:
    # The engine's bytes already read, a send that never waits: nothing in the relay suspends by itself.
    relayed: list[int] = []

    async def stream() -> AsyncIterator[bytes]:
        for i in range(2000):
            relayed.append(i)
            yield b"data: x\n\n"
        yield ClosingChunk(b"data: [DONE]\n\n")

    async def main() -> tuple[int, int]:
        seen_at: list[int] = []

        async def other_work() -> None:  # e.g. a weight update's steps, or another call's start
            for _ in range(3):
                await asyncio.sleep(0)
                seen_at.append(len(relayed))

        other = asyncio.get_running_loop().create_task(other_work())
        messages = await sent_by(None, stream())
        await other
        assert bodies(messages)[-1] == (b"data: [DONE]\n\n", False)
        return seen_at[-1], len(relayed)

    done_at, total = asyncio.run(main())
    assert done_at < 50 < total  # three turns of the other work came while the stream was relayed


def test_a_client_that_hangs_up_mid_stream_cuts_the_stream_at_its_wait() -> None:
    # The connection's watcher (the call's Hangup) sees the disconnect while the stream waits for the engine:
    # the stream's generator is cut there (and records the call as aborted), nothing more is sent, and the
    # response ends without an error (the server has no one to answer).
    cut: list[str] = []
    gone = asyncio.Event()

    async def stream() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        try:
            gone.set()
            await asyncio.sleep(3600)  # the engine's next tokens
            yield b"never sent"
        except asyncio.CancelledError:
            cut.append("cancelled at the engine's wait")
            raise

    async def main() -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            messages.append(message)

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST"}
        await asyncio.wait_for(RelayResponse(None, stream(), media_type="text/event-stream")(scope, receive, send), 5)
        return messages

    messages = asyncio.run(main())
    assert bodies(messages) == [(b"data: 1\n\n", True)]
    assert cut == ["cancelled at the engine's wait"]


def test_a_hang_up_while_a_chunk_is_written_closes_the_stream() -> None:
    # Cut at the response's own wait (the client's socket buffer full), the stream's generator is closed, so
    # that its handlers still record the call.
    closed: list[str] = []
    full = asyncio.Event()

    async def stream() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
        finally:
            closed.append("closed")

    async def main() -> None:
        async def receive() -> dict[str, Any]:
            await full.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                full.set()
                await asyncio.sleep(3600)  # the write waits for the client to read

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST"}
        await asyncio.wait_for(RelayResponse(None, stream(), media_type="text/event-stream")(scope, receive, send), 5)
        closed.append("returned")

    asyncio.run(main())
    assert closed == ["closed", "returned"]


def test_the_end_of_the_body_stops_the_watcher_before_the_bookkeeping() -> None:
    # Once the body's end is written the server answers every read with a disconnect: the stream's bookkeeping
    # after its closing chunk must still run whole, even when it waits.
    seen: list[str] = []

    async def stream() -> AsyncIterator[bytes]:
        try:
            yield ClosingChunk(b"data: [DONE]\n\n")
        finally:
            await asyncio.sleep(0.01)
            seen.append("bookkeeping")

    async def main() -> None:
        ended = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await ended.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message["more_body"]:
                ended.set()

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST"}
        await RelayResponse(None, stream(), media_type="text/event-stream")(scope, receive, send)

    asyncio.run(main())
    assert seen == ["bookkeeping"]
