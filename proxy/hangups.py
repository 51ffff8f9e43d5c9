"""Noticing a harness that hangs up while its call still waits: for the policy gate, or for the engine.

Once a request's body is read, the only message the ASGI server still has for the app is
``http.disconnect``: it comes when the client closes the connection (a timeout in its SDK, a harness
killed), or after the response is complete. A :class:`Hangup` waits for it in a task of its own, and
:meth:`Hangup.guard` runs one wait of the call against it: if the client goes first, the wait is cancelled
(an engine request is closed, so the engine stops generating for nobody) and :class:`ClientDisconnected`
is raised, which the call records as a failed call like any other error (never as a served turn the
harness did not get).

A streamed reply needs this only until its first bytes: from then on the response itself listens for the
hang-up (Starlette's streaming response), and the stream records an aborted call. The watcher must be
stopped before the response starts, so that the two never both read ``receive``.
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
        """``await work``, unless the client hangs up first: then ``work`` is cancelled (and awaited, so
        that what it holds is released) and ClientDisconnected raised. ``waiting_for`` says what the call
        was waiting for, in the error."""
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task, self._watch), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this call was cancelled itself (the server shutting down): so is the work
            task.cancel()
            raise
        if task.done():
            return task.result()
        if not self.gone:  # the watcher ended otherwise (stopped, or receive failed): go on waiting
            return await task
        task.cancel()
        await asyncio.wait((task,))  # its clean-up done (this never raises: the outcome stays in the task)
        if not task.cancelled():
            task.exception()  # it ended otherwise while being cancelled: the hang-up is what the call ends with
        raise ClientDisconnected(f"the client closed the connection while the call waited for {waiting_for}")
