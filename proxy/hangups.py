"""Noticing a harness that hangs up while its call still waits: for the policy gate, or for the engine.

Once a request's body is read, the only message the ASGI server still has for the app is
``http.disconnect``: it comes when the client closes the connection (a timeout in its SDK, a harness
killed), or after the response is complete. A :class:`Hangup` waits for it in a task of its own, and
:meth:`Hangup.guard` runs one wait of the call against it: if the client goes first, the wait is cancelled
(an engine request is closed, so the engine stops generating for nobody) and :class:`ClientDisconnected`
is raised, which the call records as a failed call like any other error (never as a served turn the
harness did not get).

A streamed reply keeps its watcher past its first bytes: the response takes it over and relays the rest
of the stream under it (:class:`proxy.relay.RelayResponse`), so that a hang-up mid-stream cuts the stream,
which records an aborted call. Only one watcher ever reads ``receive``; it is stopped before the body's end
is written, after which the server answers every read with a disconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

from proxy.errors import ClientDisconnected

T = TypeVar("T")


class Hangup:
    """Watches one request's connection from when its body has been read until :meth:`stop`."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._watch: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._wait())

    async def _wait(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return

    @property
    def gone(self) -> bool:
        """Whether the client has closed the connection."""
        return self._watch.done() and not self._watch.cancelled() and self._watch.exception() is None

    def stop(self) -> None:
        """Stop watching (before the response starts: it reads ``receive`` itself)."""
        self._watch.cancel()

    async def guard(self, work: Awaitable[T], waiting_for: str) -> T:
        """``await work``, unless the client hangs up first: then the wait is cancelled (``work`` releases
        what it holds as any cancelled await does) and ClientDisconnected raised. ``waiting_for`` says what
        the call was waiting for, in the error.

        ``work`` runs in the calling task, not in a task of its own: a call's start and its first bytes do
        not each wait for a turn of a busy event loop. The hang-up cancels the calling task, and only this
        wait: a cancellation of the call from elsewhere (the server stopping) stays a cancellation. A client
        already gone still has the work started, then cut at its first wait, so that whatever records the
        call's end (a stream's own handlers) runs as it would have a moment later."""
        task = asyncio.current_task()
        assert task is not None
        waiting, cut = True, False

        def hung_up(_: asyncio.Task[None]) -> None:
            nonlocal cut
            if waiting and self.gone:
                cut = True
                task.cancel()

        self._watch.add_done_callback(hung_up)
        try:
            result = await work
        except asyncio.CancelledError:
            if cut and task.uncancel() == 0:
                raise ClientDisconnected(
                    f"the client closed the connection while the call waited for {waiting_for}") from None
            raise
        finally:
            waiting = False
            self._watch.remove_done_callback(hung_up)
        if cut:
            task.uncancel()  # the work ended all the same (it did not let the cancellation through)
        return result
