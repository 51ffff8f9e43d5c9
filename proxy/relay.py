"""The HTTP response that relays a call's stream to the harness, with its end in one write.

A call's stream ends with its closing chunk (finish reason, usage, end marker), sent once the call is
recorded. :class:`RelayResponse` sends a :class:`ClosingChunk` together with the end of the HTTP body
(the last piece of chunked transfer encoding), so that the harness's client sees its reply complete with
that one write; what the stream's generator does after yielding it (the session's bookkeeping) runs
after the harness has its reply. Starlette's own streaming response would send the body's end separately,
after the generator had finished.

Every chunk written before the closing one gives the event loop a turn. Neither side of the relay waits by itself while there is
work: the engine's reads return at once while its bytes are already in (a proxy behind a fast engine), and
the server's send returns at once until the client's socket buffer is full. Without the turn, one long
stream relayed everything it had before anything else on the loop ran: other calls' starts, /health, a
weight update's steps.
"""

from __future__ import annotations

import asyncio

from collections.abc import AsyncIterator, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Send


class ClosingChunk(bytes):
    """The last bytes of a stream: the body ends with them."""


class RelayResponse(StreamingResponse):
    """A streaming response whose body is ``first`` (already taken from the stream, so that a failure before
    it could still be answered with an HTTP error) and then the rest of ``stream``, ending with the
    :class:`ClosingChunk` it yields (or, when none comes, when it ends). The stream is still run to its end
    after the closing chunk; anything it yields after that is not sent. A hang-up is handled as by
    Starlette's streaming response (the stream is closed)."""

    def __init__(self, first: bytes | None, stream: AsyncIterator[bytes], *, media_type: str,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(stream, media_type=media_type, headers=headers)
        self.first = first

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        if self.first is not None:
            ended = isinstance(self.first, ClosingChunk)
            await send({"type": "http.response.body", "body": self.first, "more_body": not ended})
        async for chunk in self.body_iterator:
            if ended:
                continue
            ended = isinstance(chunk, ClosingChunk)
            body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
            if not ended:
                # The loop's turn for everything else (see the module docstring); never after the closing chunk:
                # the stream's bookkeeping (the session's branch) must run before anything else, so that the
                # session's next call, which may come as soon as the client has the end, finds it.
                await asyncio.sleep(0)
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
