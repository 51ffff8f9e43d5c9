"""The HTTP response that relays a call's stream to the harness, with its end in one write.

A call's stream ends with its closing chunk (finish reason, usage, end marker), sent once the call is
recorded. :class:`RelayResponse` sends a :class:`ClosingChunk` together with the end of the HTTP body
(the last piece of chunked transfer encoding), so that the harness's client sees its reply complete with
that one write; what the stream's generator does after yielding it (the session's bookkeeping) runs
after the harness has its reply. Starlette's own streaming response would send the body's end separately,
after the generator had finished.

The stream is relayed in the call's own task. A harness that hangs up mid-stream is noticed by the call's
:class:`~proxy.hangups.Hangup` (the watcher that already guarded its wait for the engine), which cancels
the relay's wait: the stream's generator is cut at its await, as any cancelled stream is, and records the
call as aborted. Starlette's streaming response would start a task group and a second task for every call
instead, on the path of each call's first bytes.

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
from starlette.types import Receive, Scope, Send

from proxy.errors import ClientDisconnected
from proxy.hangups import Hangup


class ClosingChunk(bytes):
    """The last bytes of a stream: the body ends with them."""


class RelayResponse(StreamingResponse):
    """A streaming response whose body is ``first`` (already taken from the stream, so that a failure before
    it could still be answered with an HTTP error) and then the rest of ``stream``, ending with the
    :class:`ClosingChunk` it yields (or, when none comes, when it ends). The stream is still run to its end
    after the closing chunk; anything it yields after that is not sent. ``hangup`` is the call's watcher of
    its connection, which the response takes over (and stops once the body's end is out); without one it
    starts its own."""

    def __init__(self, first: bytes | None, stream: AsyncIterator[bytes], *, media_type: str,
                 headers: Mapping[str, str] | None = None, hangup: Hangup | None = None) -> None:
        super().__init__(stream, media_type=media_type, headers=headers)
        self.first = first
        self.hangup = hangup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hangup = self.hangup or Hangup(receive)
        try:
            await hangup.guard(self._relay(send, hangup), "the rest of its stream")
        except ClientDisconnected:
            # Cut at the stream's own await, the generator has already ended (recording the call as aborted);
            # cut at a send or at the loop's turn, it is closed here, to the same effect.
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
        finally:
            hangup.stop()

    async def _relay(self, send: Send, hangup: Hangup) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        if self.first is not None:
            ended = isinstance(self.first, ClosingChunk)
            await self._send_body(send, hangup, self.first, ended)
        async for chunk in self.body_iterator:
            if ended:
                continue
            ended = isinstance(chunk, ClosingChunk)
            body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            await self._send_body(send, hangup, body, ended)
            if not ended:
                # The loop's turn for everything else (see the module docstring); never after the closing chunk:
                # the stream's bookkeeping (the session's branch) must run before anything else, so that the
                # session's next call, which may come as soon as the client has the end, finds it.
                await asyncio.sleep(0)
        if not ended:
            await self._send_body(send, hangup, b"", True)

    @staticmethod
    async def _send_body(send: Send, hangup: Hangup, body: bytes | memoryview, ended: bool) -> None:
        if ended:
            # Once the body's end is written the server reports the connection as gone to whoever reads it:
            # the watcher stops first, so that the stream's bookkeeping after its closing chunk is never cut.
            hangup.stop()
        await send({"type": "http.response.body", "body": body, "more_body": not ended})
